"""FSDP2 with CPUOffloadPolicy on NPUs, its gradients clipped by torch's own clip_grad_norm_: the second seed.

    python -m comm.testing.cann -m torch.distributed.run --nproc-per-node 2 fsdp2_offload_clip.py
    python fsdp2_offload_clip.py --reference     # one process on the CPU, both ranks' batches at once

Each step prints ``step <n> loss <mean loss> grad_norm <norm>``. Nothing here names comm: plainly
the clip fails on torch_npu's hccl group with the seed's error; under comm it must match the
reference.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

WORLD = 2


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def batch(step, rank):
    inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return inputs, (inputs.sum(dim=1, keepdim=True).sin() * 3)


def say(line):
    os.write(1, (line + "\n").encode())


def reference(steps, max_norm):
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        parts = [batch(step, rank) for rank in range(WORLD)]
        inputs, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {step} loss {loss.item():.6f} grad_norm {norm.item():.6f}")


def on_npus(steps, max_norm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    rank = int(os.environ["RANK"])
    torch.npu.set_device(rank)
    dist.init_process_group("hccl")
    model = build_model()
    mesh = init_device_mesh("npu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        inputs, targets = batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs.to("npu")), targets.to("npu"))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            say(f"step {step} loss {mean.item() / WORLD:.6f} grad_norm {norm.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    args = parser.parse_args()
    (reference if args.reference else on_npus)(args.steps, args.max_norm)
