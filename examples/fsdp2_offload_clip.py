"""FSDP2 with CPUOffloadPolicy, its gradients clipped by torch's own clip_grad_norm_.

On the simulated NPU this is the FSDP offload report as users meet it on Ascend:
FSDP2 computes on each rank's npu over hccl, and CPU offload leaves the sharded
parameters and gradients on the CPU. torch's own clip then fails with the
report's error. Once comm.equip() puts comm's staging backend in the group's empty
CPU slot, the same torch clip works and the model trains; comm.clip_grad_norm_
gives the same norm with one collective for all the gradients.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_offload_clip.py
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_offload_clip.py --no-simulate

With --no-simulate it is plain FSDP2 on the CPU over gloo, without offload.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

import comm
import comm.testing


def say(line: str) -> None:
    if dist.get_rank() == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def build_model(mesh: DeviceMesh, offload: OffloadPolicy) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    return model


def batch(step: int, rank: int, device: torch.device) -> tuple:
    inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return inputs.to(device), (inputs.sum(dim=1, keepdim=True).sin() * 3).to(device)


def torch_clip_outcome(parameters: list, max_norm: float) -> str:
    """What torch's own clip does with these gradients (it fails before scaling any)."""
    try:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    except RuntimeError as error:
        return f"torch.nn.utils.clip_grad_norm_ fails: RuntimeError: {error}"
    return "torch.nn.utils.clip_grad_norm_: no error"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-simulate", action="store_true", help="plain CPU run over gloo, no simulated NPU")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-norm", type=float, default=1.0)
    args = parser.parse_args()
    if not args.no_simulate:
        comm.testing.simulate_accelerator("npu", "hccl")
    device = comm.bind()  # npu:<local rank> when simulating, else cpu
    dist.init_process_group(comm.default_backend(device.type))  # torch's own group: hccl, or gloo
    rank, world_size = dist.get_rank(), dist.get_world_size()
    offload = OffloadPolicy() if device.type == "cpu" else CPUOffloadPolicy()
    model = build_model(init_device_mesh(device.type, (world_size,)), offload)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    comm.reset_stats()
    where = "the CPU" if device.type == "cpu" else f"{device.type}, parameters and gradients offloaded to the CPU"
    say(f"FSDP2 on {world_size} ranks ({dist.get_backend()}), computing on {where}")
    for step in range(args.steps):
        inputs, targets = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if step == 0:
            grad = next(model.parameters()).grad
            say(f"gradient shards on {grad.to_local().device.type}, mesh on {grad.device_mesh.device_type}")
            if device.type != "cpu":
                say(torch_clip_outcome(list(model.parameters()), args.max_norm))
            staged = comm.equip()
            say(f"comm.equip(): comm stages {', '.join(sorted(staged)) or 'nothing'} on the group")
            say(f"{'step':>4} {'loss':>10} {'grad norm':>10} {'comm norm':>10}   (torch.nn.utils.clip_grad_norm_)")
        ours = comm.total_norm([p.grad for p in model.parameters()])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        # On DTensor gradients the norm is a DTensor; torch 2.9's .item() reads this rank's
        # partial norm (pytorch#170862), so read the whole one.
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        comm.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        say(f"{step:>4} {mean_loss.item():>10.4f} {norm.item():>10.4f} {ours.item():>10.4f}")
    staged = comm.stats()
    say("comm staged " + (", ".join(f"{figures['staged_calls']} {name}" for name, figures in staged.items())
                          or "nothing") + f" ({sum(f['bytes_staged'] for f in staged.values())} bytes moved)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
