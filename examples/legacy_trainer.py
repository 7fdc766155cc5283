"""A trainer written the old way, for an accelerator job: it fails as is on the NPU.

It averages CPU-side gradients and metrics with plain ``torch.distributed.all_reduce``
on the job's accelerator group and clips with ``torch.nn.utils.clip_grad_norm_``,
like trainers that offload to the CPU. On an hccl (or nccl) group that fails with
``No backend type associated with device type cpu``; under ``python -m comm`` the
same file works, unchanged:

    torchrun --standalone --nproc-per-node 2 examples/legacy_trainer.py --simulate npu          # fails
    torchrun --standalone --nproc-per-node 2 -m comm examples/legacy_trainer.py --simulate npu  # works
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               world_size: int) -> torch.Tensor:
    """One step; returns the loss averaged over the ranks."""
    loss = nn.functional.mse_loss(model(inputs), inputs.prod(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)  # a CPU tensor on the accelerator's group
        parameter.grad /= world_size
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    metric = loss.detach().reshape(1).clone()
    dist.all_reduce(metric)
    return metric / world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", metavar="DEVICE", help="simulate an accelerator (e.g. npu) on a CPU-only machine")
    parser.add_argument("--backend", default="hccl")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.simulate:
        import comm.testing

        comm.testing.simulate_accelerator(args.simulate, args.backend)
        getattr(torch, args.simulate).set_device(int(os.environ["LOCAL_RANK"]))

    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))  # kept on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    for step in range(args.steps):
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        mean_loss = train_step(model, optimizer, inputs, world_size).item()
        sys.stdout.write(f"rank {rank}: step {step} mean loss {mean_loss!r}\n")
    checksum = sum(p.detach().sum().item() for p in model.parameters())
    sys.stdout.write(f"rank {rank}: mean loss {mean_loss:.6f} parameter checksum {checksum:.6f}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
