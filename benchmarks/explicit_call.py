"""What comm's explicit call costs over torch's on a served group: ``comm.all_reduce`` against ``dist.all_reduce``.

A served call needs nothing of comm (gloo serves the CPU): comm checks what it
learnt about the group at its first call and runs torch's function. Two measures:

* wall clock: single calls in rotating order, torch's, comm's and torch's again (the
  A/A control), medians; one float on a one-rank gloo group, then on two ranks;
* instructions, with valgrind's callgrind where valgrind is installed (skipped, and
  said so, where it is not): a fresh one-rank process runs N calls of each side in
  turn (torch, comm, torch again, comm again) between marker calls (``os.getppid``,
  which callgrind is told to dump before), so each side's instructions are counted
  alone, both threads included (gloo runs the collective on a thread of its own).
  The counts are exact for what ran; what runs varies a little from side to side
  (c10d records the Python stack of every call, memory is reused differently), which
  the A/A pair shows.

    python benchmarks/explicit_call.py [--calls N] [--instruction-calls N]
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import comm

from _harness import instructions_by_part, marker, rotate, run_ranks

CALLS = 20000  # timed calls per side, one rank
CALLS_TWO_RANKS = 4000
INSTRUCTION_CALLS = 2000  # calls per side under callgrind
SIDES = ("torch", "comm", "torch again", "comm again")


def wall_clock(rank: int, calls: int) -> Dict[str, float]:
    """Median microseconds of torch's call, comm's and torch's again, one float on the default group."""
    tensor = torch.ones(1)
    reference, candidate, control = rotate(
        [lambda: dist.all_reduce(tensor), lambda: comm.all_reduce(tensor), lambda: dist.all_reduce(tensor)], calls)
    return {"torch": reference * 1e6, "comm": candidate * 1e6, "again": control * 1e6}


def _count(calls: int) -> None:
    """The process callgrind measures: ``calls`` calls of each side, a marker call before and after each side."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tensor = torch.ones(1)
    sides = {"torch": functools.partial(dist.all_reduce, tensor), "comm": functools.partial(comm.all_reduce, tensor)}
    for side in sides.values():  # the first call learns the group; then warm
        for _ in range(50):
            side()
    marker()
    for name in SIDES:
        side = sides[name.split()[0]]
        for _ in range(calls):
            side()
        marker()
    dist.destroy_process_group()


def instructions(calls: int) -> Dict[str, float]:
    """Instructions per call of each side (callgrind); empty where valgrind is not installed."""
    totals = instructions_by_part(os.path.abspath(__file__), "--count", str(calls), parts=len(SIDES))
    return {} if totals is None else {name: total / calls for name, total in zip(SIDES, totals)}


def _print_wall(label: str, calls: int, us: Dict[str, float]) -> None:
    print(f"{label}, {calls} calls per side: torch {us['torch']:.1f} us, comm {us['comm']:.1f} us, ratio "
          f"{us['comm'] / us['torch']:.3f} (A/A {us['again'] / us['torch']:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per side on one rank")
    parser.add_argument("--instruction-calls", type=int, default=INSTRUCTION_CALLS,
                        help="calls per side counted by callgrind")
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)  # the process callgrind runs
    args = parser.parse_args()
    if args.count is not None:
        _count(args.count)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; comm.all_reduce against dist.all_reduce, one float, "
          "gloo; ratio = comm / torch, A/A = torch again / torch")
    _print_wall("Wall clock, one rank", args.calls,
                run_ranks(functools.partial(wall_clock, calls=args.calls), world_size=1))
    calls_two = max(1, args.calls * CALLS_TWO_RANKS // CALLS)
    _print_wall("Wall clock, two ranks", calls_two, run_ranks(functools.partial(wall_clock, calls=calls_two)))
    counted = instructions(args.instruction_calls)
    if not counted:
        print("Instructions: skipped, valgrind is not installed (callgrind counts them)")
        return
    rows: List[Any] = [f"{name} {per_call:,.0f}" for name, per_call in counted.items()]
    print(f"Instructions per call (callgrind, one rank, {args.instruction_calls} calls per side): " + ", ".join(rows)
          + f"; ratio {counted['comm'] / counted['torch']:.3f} and {counted['comm again'] / counted['torch again']:.3f}"
          f" (A/A {counted['torch again'] / counted['torch']:.3f})")


if __name__ == "__main__":
    main()
