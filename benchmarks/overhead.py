"""What comm costs: the fast path against torch, and what the staging path issues.

Part 1, two gloo ranks: ``comm.all_reduce`` against ``torch.distributed.all_reduce``
on CPU tensors of 1, 1K and 1M elements. Batches of the two calls alternate in one
run call by call (ABBA), so both see the same machine; the table shows each side's
median per-call time and their ratio, with torch-against-torch as the control.

Part 2, one rank: what comm's fast path itself costs per call, timed with torch's
collective replaced by a no-op, beside a bare pass-through wrapper. On two ranks
sharing two cores each 0.1 us spent before a small collective comes back as
about 3 us of latency, so part 1 shows this cost magnified.

Part 3, two ranks on the simulated NPU (hccl): N CPU tensors reduced through
comm; it counts host<->device transfers and collectives issued.

    python benchmarks/overhead.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import timeit
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import comm
import comm.testing

from _launch import run_ranks

SIZES = (1, 1024, 1024 * 1024)
CALLS = {1: 10000, 1024: 10000, 1024 * 1024: 3000}  # timed calls per side: 1M calls vary by 35%
WARMUP = 50
DECISION_CALLS, DECISION_REPEATS = 200_000, 7
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


def decision_cost(rank: int) -> Dict[str, float]:
    """Nanoseconds per call of comm's fast path and of a bare wrapper, around a no-op collective."""
    import comm.collectives

    def no_collective(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    def bare_wrapper(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return no_collective(tensor, op, group, async_op)

    tensor = torch.ones(1)
    comm.all_reduce(tensor)  # the first call resolves the group; later ones take the fast path
    comm.collectives._torch_all_reduce = no_collective
    names = {"no-op": no_collective, "bare wrapper": bare_wrapper, "comm": comm.all_reduce}
    return {name: _ns_per_call(fn, tensor) for name, fn in names.items()}


def _ns_per_call(fn: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> float:
    timings = timeit.repeat("fn(tensor)", globals={"fn": fn, "tensor": tensor}, number=DECISION_CALLS,
                            repeat=DECISION_REPEATS)
    return min(timings) / DECISION_CALLS * 1e9


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
    print("\nThe fast path's own cost: ns per call around a no-op collective (timeit, best of 7)")
    costs = run_ranks(decision_cost, world_size=1)
    print("  " + ", ".join(f"{name} {ns:.0f} ns" for name, ns in costs.items())
          + f"; comm over the bare wrapper: {costs['comm'] - costs['bare wrapper']:+.0f} ns")
    print("\nStaging path: N CPU tensors of 256 floats on the simulated NPU's hccl group")
    print(f"{'tensors':>8} {'coalesced: transfers':>21} {'collectives':>12} {'one by one: transfers':>22} "
          f"{'collectives':>12} {'correct':>8}")
    for row in run_ranks(staging_counts, backend="hccl", simulate={"name": "npu", "backend": "hccl"}):
        print(f"{row['tensors']:>8} {row['transfers']:>21} {row['collectives']:>12} "
              f"{row['one_by_one_transfers']:>22} {row['one_by_one_collectives']:>12} {str(row['correct']):>8}")


if __name__ == "__main__":
    main()
