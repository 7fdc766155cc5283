"""What comm costs inside torch.compile: a compiled step calling comm against the same step calling torch.

Two gloo ranks; each step doubles a CPU tensor, all-reduces it and adds one, all
compiled (inductor, fullgraph). The candidates are the step calling
``comm.all_reduce``, calling ``torch.distributed.all_reduce`` under
``comm.patch()``, and torch's own step compiled a second time (the A/A control:
the harness's own noise and bias). Single calls of torch's step and the
candidates alternate in rotating order, so drift hits all alike; the table shows
medians per call and each candidate's ratio to torch.

The order in which the steps are compiled matters by itself: measured with
torch's fake process group (no communication), a step compiled later ran 3 to 5%
faster than an identical one compiled earlier. So each run compiles in one order
and then the reverse, in fresh processes, and the ratio shown is the geometric
mean of the two.

    python benchmarks/compiled.py
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import comm

from _harness import rotate, run_ranks

SIZES = (16, 1024)
CALLS = 3000  # timed calls per candidate and size


def torch_step(tensor: torch.Tensor) -> torch.Tensor:
    doubled = tensor * 2
    dist.all_reduce(doubled)
    return doubled + 1


def torch_step_again(tensor: torch.Tensor) -> torch.Tensor:
    """torch_step under another name: its own code object, so dynamo compiles and guards it apart."""
    doubled = tensor * 2
    dist.all_reduce(doubled)
    return doubled + 1


def comm_step(tensor: torch.Tensor) -> torch.Tensor:
    doubled = tensor * 2
    comm.all_reduce(doubled)
    return doubled + 1


def _patched_step() -> Callable[[torch.Tensor], torch.Tensor]:
    """The step as dynamo sees it under comm.patch(): calling the stand-in torch.distributed then holds."""
    with comm.patched():
        stand_in = dist.all_reduce

    def patched_step(tensor: torch.Tensor) -> torch.Tensor:
        doubled = tensor * 2
        stand_in(doubled)
        return doubled + 1

    return patched_step


def compare(rank: int, reverse: bool) -> List[Dict[str, Any]]:
    steps = {"torch": torch_step, "comm": comm_step, "patched torch": _patched_step(),
             "torch again": torch_step_again}
    names = list(reversed(steps)) if reverse else list(steps)
    compiled = {name: torch.compile(steps[name], fullgraph=True, dynamic=False) for name in names}
    rows = []
    for size in SIZES:
        tensor = torch.ones(size)
        medians = dict(zip(compiled, rotate([functools.partial(step, tensor) for step in compiled.values()], CALLS)))
        for name in ("comm", "patched torch", "torch again"):
            rows.append({"candidate": name, "elements": size, "torch_us": medians["torch"] * 1e6,
                         "candidate_us": medians[name] * 1e6, "ratio": medians[name] / medians["torch"]})
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    rows.append({"graphs": graphs})
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, 2 gloo ranks: a compiled step (inductor, fullgraph) "
          f"against torch's; medians of {CALLS} single calls per candidate in rotating order")
    print("each compiled in one order, then the reverse (us per call: first/second run; ratio: their geometric mean)")
    print(f"{'candidate':>14} {'elements':>9} {'torch us/call':>14} {'candidate us/call':>18} {'ratio':>7}")
    forward, backward = (run_ranks(functools.partial(compare, reverse=reverse)) for reverse in (False, True))
    for first, second in zip(forward[:-1], backward[:-1]):
        ratio = math.sqrt(first["ratio"] * second["ratio"])
        print(f"{first['candidate']:>14} {first['elements']:>9} {_both(first['torch_us'], second['torch_us']):>14} "
              f"{_both(first['candidate_us'], second['candidate_us']):>18} {ratio:>7.3f}"
              f"   ({first['ratio']:.3f} and {second['ratio']:.3f})")
    print(f"graphs compiled per run: {forward[-1]['graphs']} and {backward[-1]['graphs']} "
          "(one per step and size: no recompilation per call)")


def _both(first: float, second: float) -> str:
    return f"{first:.0f}/{second:.0f}"


if __name__ == "__main__":
    main()
