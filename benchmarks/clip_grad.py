"""comm.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on an FSDP2 model.

A model of 100 linear layers (200 parameters) sharded with fully_shard layer by
layer, on two ranks: on gloo (CPU), and on two simulated NPUs (hccl) with
CPUOffloadPolicy, where the gradients live on the CPU and comm's backend, in the
group's CPU slot, stages torch's reduction of their norm. Single calls in rotating
order: torch's, comm's and torch's again (the A/A control). The table shows each
side's median, the ratio to torch's, the collectives each issues (counted from the
profiler's backend events on gloo) and the norm.

    python benchmarks/clip_grad.py [--calls N]
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable, Dict

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import comm

from _harness import rotate, run_ranks

LAYERS = 100
CALLS = 200
NPU = {"name": "npu", "backend": "hccl"}


def _sharded_model(device_type: str, offload: bool) -> nn.Module:
    mesh = init_device_mesh(device_type, (2,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)]).to(device_type)
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    model(torch.randn(4, 16, device=device_type)).sum().backward()
    return model


def _collectives(fn: Callable[[], Any]) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return sum(1 for event in profile.events() if event.name.startswith("gloo:"))


def compare(rank: int, device_type: str, offload: bool, calls: int) -> Dict[str, float]:
    if device_type != "cpu":
        comm.equip()  # what python -m comm does: torch's clip of CPU-offloaded gradients then stages
    model = _sharded_model(device_type, offload)
    parameters = list(model.parameters())
    # max_norm high enough that clipping scales by 1: the gradients stay the same throughout.
    torch_clip = functools.partial(torch.nn.utils.clip_grad_norm_, parameters, 1e9)
    comm_clip = functools.partial(comm.clip_grad_norm_, parameters, 1e9)
    torch_s, comm_s, again_s = rotate([torch_clip, comm_clip, torch_clip], calls)
    return {
        "parameters": len(parameters),
        "torch_ms": torch_s * 1e3,
        "comm_ms": comm_s * 1e3,
        "again_ms": again_s * 1e3,
        "torch_collectives": _collectives(torch_clip) if device_type == "cpu" else -1,
        "comm_collectives": _collectives(comm_clip) if device_type == "cpu" else -1,
        "torch_norm": float(torch.as_tensor(torch_clip().full_tensor())),
        "comm_norm": float(comm_clip()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per side")
    args = parser.parse_args()
    print(f"\nclip_grad_norm_ on FSDP2 (torch {torch.__version__}, {os.cpu_count()} CPUs, 2 ranks, "
          f"{LAYERS * 2} parameters, medians of {args.calls} single calls per side in rotating order)")
    print(f"{'':>44} {'torch ms':>9} {'comm ms':>9} {'ratio':>7} {'A/A':>7} {'collectives':>12} {'norm':>12}")
    scenarios = [("gloo, CPU", dict(device_type="cpu", offload=False), {}),
                 ("simulated NPUs, hccl, CPUOffloadPolicy", dict(device_type="npu", offload=True),
                  dict(backend="hccl", simulate=NPU))]
    for title, options, launch in scenarios:
        row = run_ranks(functools.partial(compare, calls=args.calls, **options), **launch)
        collectives = (f"{row['torch_collectives']} / {row['comm_collectives']}" if row["torch_collectives"] >= 0
                       else "")
        print(f"{title:>44} {row['torch_ms']:>9.2f} {row['comm_ms']:>9.2f} {row['comm_ms'] / row['torch_ms']:>7.3f} "
              f"{row['again_ms'] / row['torch_ms']:>7.3f} {collectives:>12} "
              f"{row['torch_norm']:.6f} / {row['comm_norm']:.6f}")


if __name__ == "__main__":
    main()
