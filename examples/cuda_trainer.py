"""A DDP trainer written for CUDA, the way tutorials write it. Not a line of it knows comm.

    torchrun --nproc-per-node 2 train.py                          # on a CUDA machine
    torchrun --nproc-per-node 2 -m comm --simulate npu examples/cuda_trainer.py   # two simulated NPUs
    torchrun --nproc-per-node 2 -m comm examples/cuda_trainer.py  # a CPU-only machine (gloo)

Without comm, on a torch without CUDA, it stops at its first line that names CUDA:
``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH_SIZE = 8  # per rank
LEARNING_RATE = 0.05


def make_dataset(samples: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(samples, 16, generator=generator)
    targets = inputs[:, :4].sum(dim=1, keepdim=True).tanh()
    return TensorDataset(inputs, targets)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def report(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write, so ranks' lines do not interleave
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    # The first seed's entry point, line for line.
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", device_id=torch.cuda.current_device())
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = make_model().cuda(local_rank)
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, pin_memory=True)
    device = torch.device("cuda", local_rank)
    report(f"rank {rank}/{world_size}: cuda available {torch.cuda.is_available()}, {torch.cuda.device_count()} "
           f"devices, current {torch.cuda.current_device()}, model on {next(model.parameters()).device}, "
           f"backend {dist.get_backend()}")

    total = torch.ones(1).cuda(local_rank) * (rank + 1)
    dist.all_reduce(total)  # the seed's check: the sum over ranks
    report(f"rank {rank}: all_reduce sum {total.item():g}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (inputs, targets) in enumerate(loader):
            inputs = inputs.cuda(local_rank, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report(f"rank {rank}: epoch {epoch} step {step} loss {loss.item():.8f} on {loss.device}")
        torch.cuda.synchronize()
        allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        reserved = torch.cuda.memory_reserved()
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        report(f"rank {rank}: epoch {epoch} memory allocated {allocated} peak {peak} reserved {reserved} "
               f"-> {torch.cuda.memory_reserved()} after empty_cache")
        torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
