"""What comm costs: the fast path against torch, and what the staging path issues.

Part 1, two gloo ranks: ``comm.all_reduce`` against ``torch.distributed.all_reduce``
on CPU tensors of 1, 1K and 1M elements. Batches of the two calls alternate in one
run call by call (ABBA), so both see the same machine; the table shows each side's
median per-call time and their ratio, with torch-against-torch as the control.

Part 2, one rank: the CPU time the calling thread spends per call, which is what
the wrapper costs; two-rank latency on a 2-core machine also moves with how the
ranks' arrivals line up, as the torch-against-torch control shows.

Part 3, two ranks on the simulated NPU (hccl): N CPU tensors reduced through
comm; it counts host<->device transfers and collectives issued.

    python benchmarks/overhead.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import comm
import comm.testing

from _launch import run_ranks

SIZES = (1, 1024, 1024 * 1024)
CALLS = {1: 4000, 1024: 4000, 1024 * 1024: 400}  # timed calls per side
WARMUP = 50
COST_BLOCKS, COST_CALLS = 20, 1000
TENSOR_COUNTS = (1, 8, 64)


def _time_call(fn: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(tensor)
    return time.perf_counter() - start


def _torch_again(tensor: torch.Tensor) -> Any:
    """torch's own call under another name: the A/A control for the harness's bias."""
    return dist.all_reduce(tensor)


def fast_path(rank: int) -> List[Dict[str, float]]:
    return _compare(comm.all_reduce) + _compare(_torch_again)


def _compare(candidate: Callable[[torch.Tensor], Any]) -> List[Dict[str, float]]:
    """Alternate single calls (ABBA), so drift hits both sides alike; compare medians."""
    rows = []
    for size in SIZES:
        tensor = torch.ones(size)
        calls = CALLS[size]
        for _ in range(WARMUP):
            _time_call(dist.all_reduce, tensor)
            _time_call(candidate, tensor)
        torch_times, candidate_times = [], []
        for index in range(calls):
            pair = [(dist.all_reduce, torch_times), (candidate, candidate_times)]
            for fn, times in pair if index % 2 == 0 else reversed(pair):
                times.append(_time_call(fn, tensor))
        torch_median, candidate_median = statistics.median(torch_times), statistics.median(candidate_times)
        rows.append({"candidate": candidate.__name__, "elements": size, "torch_us": torch_median * 1e6,
                     "comm_us": candidate_median * 1e6, "ratio": candidate_median / torch_median})
    return rows


def cpu_cost(rank: int) -> List[Dict[str, float]]:
    """CPU time the calling thread spends per call, on a 1-rank group: no peer to wait for."""
    tensor = torch.ones(1)
    rows = []
    for candidate in (comm.all_reduce, _torch_again):
        spent = {"torch": 0.0, "candidate": 0.0}
        for block in range(COST_BLOCKS):
            pair = [("torch", dist.all_reduce), ("candidate", candidate)]
            for side, fn in pair if block % 2 == 0 else reversed(pair):
                start = time.thread_time()
                for _ in range(COST_CALLS):
                    fn(tensor)
                spent[side] += time.thread_time() - start
        calls = COST_BLOCKS * COST_CALLS
        rows.append({"candidate": candidate.__name__, "torch_us": spent["torch"] / calls * 1e6,
                     "comm_us": spent["candidate"] / calls * 1e6})
    return rows


def staging_counts(rank: int) -> List[Dict[str, float]]:
    rows = []
    for count in TENSOR_COUNTS:
        tensors = [torch.full((256,), float(rank)) for _ in range(count)]
        dist.barrier()
        comm.testing.reset_counters()
        start = time.perf_counter()
        comm.all_reduce_coalesced(tensors)
        seconds = time.perf_counter() - start
        counted = comm.testing.counters()
        correct = all(torch.equal(t, torch.full((256,), 1.0)) for t in tensors)
        comm.testing.reset_counters()
        for tensor in tensors:
            comm.all_reduce(tensor)
        one_by_one = comm.testing.counters()
        rows.append({"tensors": count, "transfers": counted["transfers"], "collectives": counted["collectives"],
                     "one_by_one_transfers": one_by_one["transfers"],
                     "one_by_one_collectives": one_by_one["collectives"], "ms": seconds * 1e3, "correct": correct})
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 2 ranks; medians of single calls taken in ABBA order")
    print("\nFast path: each candidate vs torch.distributed.all_reduce (CPU tensors, gloo);")
    print("the torch-vs-torch rows are the A/A control: the harness's own noise and bias")
    print(f"{'candidate':>12} {'elements':>10} {'torch us/call':>14} {'candidate us/call':>18} {'ratio':>7}")
    for row in run_ranks(fast_path):
        name = "comm" if row["candidate"] == "all_reduce" else "torch again"
        print(f"{name:>12} {row['elements']:>10} {row['torch_us']:>14.1f} {row['comm_us']:>18.1f} {row['ratio']:>7.3f}")
    print("\nCPU time of the calling thread per call, 1-rank gloo group (no peer to wait for), 1 element")
    for row in run_ranks(cpu_cost, world_size=1):
        name = "comm" if row["candidate"] == "all_reduce" else "torch again"
        print(f"{name:>12}: torch {row['torch_us']:.2f} us, {name} {row['comm_us']:.2f} us, "
              f"difference {row['comm_us'] - row['torch_us']:+.2f} us")
    print("\nStaging path: N CPU tensors of 256 floats on the simulated NPU's hccl group")
    print(f"{'tensors':>8} {'coalesced: transfers':>21} {'collectives':>12} {'one by one: transfers':>22} "
          f"{'collectives':>12} {'correct':>8}")
    for row in run_ranks(staging_counts, backend="hccl", simulate={"name": "npu", "backend": "hccl"}):
        print(f"{row['tensors']:>8} {row['transfers']:>21} {row['collectives']:>12} "
              f"{row['one_by_one_transfers']:>22} {row['one_by_one_collectives']:>12} {str(row['correct']):>8}")


if __name__ == "__main__":
    main()
