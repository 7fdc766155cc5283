"""The chunk size of a large staged all-reduce, and what the pipeline gains (issue 47).

Two ranks on the simulated NPU (hccl), a CPU tensor all-reduced through torch's function:
comm's staging with COMM_STAGING_CHUNK_BYTES at each of CHUNKS (0: one copy in, one
collective, one copy back; else chunks of that size, pipelined), against the fix by hand
and the fix again (A/A), single calls in rotating order from a settled device. Then the
three parts of an unchunked call timed alone (the copy in through a pinned buffer, the
collective on the device, the copy back through a pinned buffer): their sum is what the
call costs with no overlap at all.

    python benchmarks/chunking.py [--mib 64] [--calls 8]
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import comm

from _harness import Call, rotate, run_ranks

CHUNKS = (0, 4 << 20, 8 << 20, 16 << 20, 32 << 20)  # bytes; 0: unchunked
NPU = {"name": "npu", "backend": "hccl"}


def _group_chunked(chunk_bytes: int) -> dist.ProcessGroup:
    """A group of both ranks, equipped (under comm.patch()) with chunks of ``chunk_bytes``."""
    os.environ["COMM_STAGING_CHUNK_BYTES"] = str(chunk_bytes)
    return dist.new_group([0, 1])


def _settle() -> None:
    dist.barrier()
    torch.accelerator.synchronize()


def _parts(x: torch.Tensor, device: torch.device) -> List[Call]:
    """An unchunked staged all-reduce's three parts, each on its own: copy in, collective, copy back."""
    pinned = torch.empty(x.shape, pin_memory=True)
    staged = torch.empty(x.shape, device=device)

    def copy_in() -> None:
        host = torch.empty(x.shape, pin_memory=True)
        host.copy_(x)
        torch.empty(x.shape, device=device).copy_(host, non_blocking=True)

    def collective() -> None:
        dist.all_reduce(staged)
        torch.accelerator.synchronize()

    def copy_back() -> None:
        pinned.copy_(staged, non_blocking=True)
        torch.accelerator.synchronize()
        x.copy_(pinned)

    return [copy_in, collective, copy_back]


def sweep(rank: int, mib: int, calls: int) -> Dict[str, Any]:
    comm.patch()
    device = comm.current_device()
    x = torch.ones(mib << 18)
    groups = {chunk: _group_chunked(chunk) for chunk in CHUNKS}

    def by_hand() -> None:
        staged = x.to(device)
        dist.all_reduce(staged)
        x.copy_(staged)

    staged = [functools.partial(dist.all_reduce, x, group=groups[chunk]) for chunk in CHUNKS]
    sides = [by_hand, *staged, by_hand]
    medians = rotate(sides, calls, setups=[_settle] * len(sides), warmup=2)
    parts = rotate(_parts(x, device), calls, setups=[_settle] * 3, warmup=2)
    return {"medians": medians, "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="the all-reduced tensor, MiB")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per side")
    args = parser.parse_args()
    found = run_ranks(functools.partial(sweep, mib=args.mib, calls=args.calls), backend="hccl", simulate=NPU)
    medians, parts = found["medians"], found["parts"]
    hand = medians[0]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; staged all_reduce of {args.mib} MiB on 2 simulated "
          f"NPUs, medians of {args.calls} calls per side in rotating order, rank 0")
    print(f"{'side':>22} {'ms':>9} {'/ by hand':>10}")
    print(f"{'by hand':>22} {hand * 1e3:>9.1f} {1:>10.3f}")
    for chunk, median in zip(CHUNKS, medians[1:-1]):
        name = "staged, unchunked" if chunk == 0 else f"staged, {chunk >> 20} MiB chunks"
        print(f"{name:>22} {median * 1e3:>9.1f} {median / hand:>10.3f}")
    print(f"{'by hand again (A/A)':>22} {medians[-1] * 1e3:>9.1f} {medians[-1] / hand:>10.3f}")
    names = ("copy in", "collective", "copy back")
    print("parts alone, ms: " + ", ".join(f"{n} {p * 1e3:.1f}" for n, p in zip(names, parts))
          + f"; sum {sum(parts) * 1e3:.1f}, the slowest {max(parts) * 1e3:.1f}")


if __name__ == "__main__":
    main()
