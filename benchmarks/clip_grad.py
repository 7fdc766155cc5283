"""comm.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on an FSDP2 model.

Two gloo ranks, a model of 100 linear layers (200 parameters) sharded with
fully_shard layer by layer. Calls alternate one by one (ABBA); the table shows
each side's median time, their ratio, and the collectives each issues (counted
from the profiler's backend events).

    python benchmarks/clip_grad.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Dict

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import comm

from _harness import run_ranks

LAYERS = 100
CALLS = 200


def _sharded_model() -> nn.Module:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 16)).sum().backward()
    return model


def _collectives(fn: Callable[[], Any]) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return sum(1 for event in profile.events() if event.name.startswith("gloo:"))


def compare(rank: int) -> Dict[str, float]:
    model = _sharded_model()
    parameters = list(model.parameters())
    # max_norm high enough that clipping scales by 1: the gradients stay the same throughout.
    sides = {
        "torch": lambda: torch.nn.utils.clip_grad_norm_(parameters, 1e9),
        "comm": lambda: comm.clip_grad_norm_(parameters, 1e9),
    }
    times: Dict[str, list] = {name: [] for name in sides}
    for index in range(CALLS):
        order = list(sides) if index % 2 == 0 else list(sides)[::-1]
        for name in order:
            start = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - start)
    norms = {name: float(fn()) for name, fn in sides.items()}
    return {
        "parameters": len(parameters),
        "torch_ms": statistics.median(times["torch"]) * 1e3,
        "comm_ms": statistics.median(times["comm"]) * 1e3,
        "torch_collectives": _collectives(sides["torch"]),
        "comm_collectives": _collectives(sides["comm"]),
        "torch_norm": norms["torch"],
        "comm_norm": norms["comm"],
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    row = run_ranks(compare)
    print(f"\nclip_grad_norm_ on FSDP2 (torch {torch.__version__}, {os.cpu_count()} CPUs, 2 gloo ranks, "
          f"{row['parameters']} parameters, median of {CALLS} calls each)")
    print(f"{'':>8} {'ms/call':>8} {'collectives':>12} {'norm':>12}")
    print(f"{'torch':>8} {row['torch_ms']:>8.2f} {row['torch_collectives']:>12} {row['torch_norm']:>12.6f}")
    print(f"{'comm':>8} {row['comm_ms']:>8.2f} {row['comm_collectives']:>12} {row['comm_norm']:>12.6f}")
    print(f"ratio comm/torch: {row['comm_ms'] / row['torch_ms']:.3f}")


if __name__ == "__main__":
    main()
