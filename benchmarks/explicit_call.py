"""What each of comm's 21 explicit calls costs over torch's own on a served group: ``comm.<name>`` against torch's.

A served call needs nothing of comm (gloo serves the CPU): comm checks what it
learnt about the group at its first call and runs torch's function. Two ranks on a
gloo group, 16 floats per tensor, each call as a trainer makes it (point-to-point
calls paired with the peer's counterpart; async calls waited for). Two measures per call:

* wall clock: single calls in rotating order, torch's, comm's and torch's again (the
  A/A control), medians of rank 0's;
* instructions, with valgrind's callgrind where valgrind is installed (skipped, and
  said so, where it is not): rank 0 runs under callgrind (rank 1 beside it, not
  counted), N calls of each side in turn (torch, comm, torch again, comm again)
  between marker calls (``os.getppid``, which callgrind is told to dump before), so
  each side's instructions are counted alone. Only the main thread's: gloo's own
  threads spin while they wait for the peer, by as much as the peer's timing makes
  them; the main thread runs all that comm adds. The counts are exact for what ran;
  what runs varies a little from side to side (c10d records the Python stack of
  every call, memory is reused differently), which the A/A pair shows.

    python benchmarks/explicit_call.py [--calls N] [--instruction-calls N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import comm
from comm.collectives import COLLECTIVES

from _harness import instructions_by_part, marker, rotate, run_ranks

CALLS = 2000  # timed calls per side and call
INSTRUCTION_CALLS = 300  # calls per side under callgrind
NUMEL = 16
SIDES = ("torch", "comm", "torch again", "comm again")
Make = Callable[[ModuleType, int], Callable[[], Any]]


def _floats(numel: int = NUMEL) -> torch.Tensor:
    return torch.ones(numel)


def _waited(work: Any) -> None:
    for each in work if isinstance(work, list) else [work]:
        each.wait()


def _p2p(mine: str, theirs: str) -> Make:
    """A point-to-point row: rank 0 makes call ``mine`` to rank 1, which makes ``theirs`` back (waited if async)."""

    def make(module: ModuleType, rank: int) -> Callable[[], Any]:
        tensor = _floats()
        name, peer = (mine, 1) if rank == 0 else (theirs, 0)
        call = getattr(module, name)
        if name.startswith("i"):
            return lambda: call(tensor, peer).wait()
        return lambda: call(tensor, peer)

    return make


def _batch(module: ModuleType, rank: int) -> Callable[[], Any]:
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, _floats(), peer), dist.P2POp(dist.irecv, _floats(), peer)]
    return lambda: _waited(module.batch_isend_irecv(ops))


def _collective(make_args: Callable[[int], Dict[str, Any]], name: str) -> Make:
    def make(module: ModuleType, rank: int) -> Callable[[], Any]:
        return functools.partial(getattr(module, name), **make_args(rank))

    return make


# Each call's arguments on rank `rank` of two: torch's parameter names, as a trainer passes them.
ARGUMENTS: Dict[str, Callable[[int], Dict[str, Any]]] = {
    "all_reduce": lambda rank: dict(tensor=_floats()),
    "all_reduce_coalesced": lambda rank: dict(tensors=[_floats(), _floats()]),
    "broadcast": lambda rank: dict(tensor=_floats(), src=0),
    "reduce": lambda rank: dict(tensor=_floats(), dst=0),
    "all_gather": lambda rank: dict(tensor_list=[_floats(), _floats()], tensor=_floats()),
    "all_gather_into_tensor": lambda rank: dict(output_tensor=_floats(2 * NUMEL), input_tensor=_floats()),
    "all_gather_single": lambda rank: dict(output_tensor=_floats(2 * NUMEL), input_tensor=_floats()),
    "all_gather_coalesced": lambda rank: dict(output_tensor_lists=[[_floats()], [_floats()]],
                                              input_tensor_list=[_floats()]),
    "reduce_scatter": lambda rank: dict(output=_floats(), input_list=[_floats(), _floats()]),
    "reduce_scatter_tensor": lambda rank: dict(output=_floats(), input=_floats(2 * NUMEL)),
    "reduce_scatter_single": lambda rank: dict(output=_floats(), input=_floats(2 * NUMEL)),
    "gather": lambda rank: dict(tensor=_floats(), gather_list=[_floats(), _floats()] if rank == 0 else None, dst=0),
    "scatter": lambda rank: dict(tensor=_floats(), scatter_list=[_floats(), _floats()] if rank == 0 else None, src=0),
    "all_to_all": lambda rank: dict(output_tensor_list=[_floats(), _floats()],
                                    input_tensor_list=[_floats(), _floats()]),
    "all_to_all_single": lambda rank: dict(output=_floats(2 * NUMEL), input=_floats(2 * NUMEL)),
    "barrier": lambda rank: dict(),
}
ROWS: Dict[str, Make] = {
    **{name: _collective(make_args, name) for name, make_args in ARGUMENTS.items()},
    "send": _p2p("send", "recv"),
    "isend": _p2p("isend", "irecv"),
    "recv": _p2p("recv", "send"),
    "irecv": _p2p("irecv", "isend"),
    "batch_isend_irecv": _batch,
}
assert sorted(ROWS) == sorted(COLLECTIVES), "a row for each of comm's explicit calls"


def _sides(name: str, rank: int) -> List[Callable[[], Any]]:
    """torch's call, comm's, and torch's again, each on tensors of its own."""
    return [ROWS[name](dist, rank), ROWS[name](comm, rank), ROWS[name](dist, rank)]


def _runnable(names: Sequence[str]) -> List[str]:
    """``names`` less the calls this torch's gloo lacks (torch 2.9's gloo has no list all_to_all)."""
    try:
        ROWS["all_to_all"](dist, dist.get_rank())()
    except RuntimeError:
        return [name for name in names if name != "all_to_all"]
    return list(names)


def wall_clock(rank: int, names: Sequence[str], calls: int) -> Dict[str, Dict[str, float]]:
    """Per call: median microseconds of torch's call, comm's and torch's again, on the default group."""
    warnings.simplefilter("ignore", FutureWarning)  # torch's *_tensor deprecations, alike on both sides
    times = {}
    for name in _runnable(names):
        reference, candidate, control = rotate(_sides(name, rank), calls)
        times[name] = {"torch": reference * 1e6, "comm": candidate * 1e6, "again": control * 1e6}
    return times


def _count(names: Sequence[str], calls: int, rank: int, store: str) -> None:
    """A rank of the process callgrind measures (rank 0; it starts rank 1 beside it, not counted): per call, its
    warm-up, a marker call, then ``calls`` calls of each side, each followed by a marker call."""
    peer = None
    if rank == 0:
        peer = subprocess.Popen([sys.executable, __file__, "--count", str(calls), "--rank", "1", "--store", store,
                                 "--only", *names])
    warnings.simplefilter("ignore", FutureWarning)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    for name in names:
        torch_side, comm_side, _ = _sides(name, rank)
        sides = {"torch": torch_side, "comm": comm_side}
        for side in sides.values():  # the first call learns the group; then warm
            for _ in range(50):
                side()
        marker()
        for label in SIDES:
            side = sides[label.split()[0]]
            for _ in range(calls):
                side()
            marker()
    dist.destroy_process_group()
    if peer is not None and peer.wait() != 0:
        raise RuntimeError("rank 1 of the counted run failed")


def instructions(names: Sequence[str], calls: int) -> Dict[str, Dict[str, float]]:
    """Per call, instructions per call of each side (callgrind, rank 0); empty where valgrind is not installed."""
    with tempfile.TemporaryDirectory() as workdir:
        totals = instructions_by_part(os.path.abspath(__file__), "--count", str(calls), "--rank", "0",
                                      "--store", os.path.join(workdir, "store"), "--only", *names,
                                      parts=(len(SIDES) + 1) * len(names) - 1, main_thread=True)
    if totals is None:
        return {}
    counted = {}
    for index, name in enumerate(names):  # each call's warm-up, then its sides (the first warm-up is not a part)
        start = index * (len(SIDES) + 1)
        part = totals[start:start + len(SIDES)]
        counted[name] = {label: total / calls for label, total in zip(SIDES, part)}
    return counted


def _table(times: Dict[str, Dict[str, float]], counted: Dict[str, Dict[str, float]], calls: int,
           instruction_calls: int) -> str:
    counts = (f"callgrind, {instruction_calls} calls per side" if counted else "not counted" if not instruction_calls
              else "skipped, valgrind is not installed (callgrind counts them)")
    rows = [f"Two ranks, gloo, {NUMEL} floats; wall clock: medians of {calls} calls per side; instructions: {counts}",
            "| call | torch (us) | comm (us) | ratio | A/A | torch (instructions) | comm | ratio | A/A |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, us in times.items():
        row = (f"| `{name}` | {us['torch']:.1f} | {us['comm']:.1f} | {us['comm'] / us['torch']:.3f} | "
               f"{us['again'] / us['torch']:.3f} |")
        count: Optional[Dict[str, float]] = counted.get(name)
        if count:
            ratio = (count["comm"] + count["comm again"]) / (count["torch"] + count["torch again"])
            row += (f" {count['torch']:,.0f} | {count['comm']:,.0f} | {ratio:.4f} | "
                    f"{count['torch again'] / count['torch']:.4f} |")
        else:
            row += " | | | |"
        rows.append(row)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per side and call")
    parser.add_argument("--instruction-calls", type=int, default=INSTRUCTION_CALLS,
                        help="calls per side counted by callgrind (0: none)")
    parser.add_argument("--only", nargs="+", choices=sorted(ROWS), default=list(ROWS), help="these calls alone")
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)  # a rank of the process callgrind runs
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count is not None:
        _count(args.only, args.count, args.rank, args.store)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; comm's explicit calls against torch's on a served "
          "group; ratio = comm / torch (instructions: both comm sides over both torch sides), "
          "A/A = torch again / torch")
    times = run_ranks(functools.partial(wall_clock, names=args.only, calls=args.calls))
    counted = instructions(list(times), args.instruction_calls) if args.instruction_calls else {}
    print(_table(times, counted, args.calls, args.instruction_calls))


if __name__ == "__main__":
    main()
