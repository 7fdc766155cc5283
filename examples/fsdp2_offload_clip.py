"""FSDP2 with gradients on the CPU, clipped with comm.clip_grad_norm_.

On the simulated NPU the gradients reach clipping as FSDP2 with CPUOffloadPolicy
hands them over on Ascend: local shards on the CPU, mesh on the NPU's hccl group.
torch's own clip then fails with the FSDP offload report's error; comm's works.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_offload_clip.py
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_offload_clip.py --no-simulate

The model computes on the CPU over gloo in both modes (the simulated device cannot
host FSDP2's parameter storage); only where clipping reduces differs.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import comm
import comm.testing


def say(line: str) -> None:
    if dist.get_rank() == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def build_model(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple:
    inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return inputs, inputs.sum(dim=1, keepdim=True).sin() * 3


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
    comm.init_process_group("gloo")  # binds npu:<local rank> when simulating; FSDP computes over gloo
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.no_simulate:
        where = "cpu mesh (gloo)"
        views = list(model.parameters())
    else:
        npu_mesh = DeviceMesh.from_group(dist.new_group(backend="hccl"), "npu")
        where = "npu mesh (hccl), local shards on the CPU"
        views = [comm.testing.offloaded(p, npu_mesh) for p in model.parameters()]
    comm.reset_stats()
    say(f"FSDP2 on {world_size} ranks; gradients clipped on the {where}")
    for step in range(args.steps):
        inputs, targets = batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if not args.no_simulate:
            for view, param in zip(views, model.parameters()):
                view.grad = comm.testing.offloaded(param.grad, view.device_mesh)
        if step == 0:
            if not args.no_simulate:
                say(torch_clip_outcome(views, args.max_norm))
            say(f"{'step':>4} {'loss':>10} {'grad norm':>10}   (comm.clip_grad_norm_)")
        norm = comm.clip_grad_norm_(views, args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        comm.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        say(f"{step:>4} {mean_loss.item():>10.4f} {norm.item():>10.4f}")
    staged = comm.stats().get("all_reduce", {})
    say(
        f"comm staged {staged.get('staged_calls', 0)} of {staged.get('calls', 0)} all_reduce calls "
        f"({staged.get('bytes_staged', 0)} bytes moved between devices)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
