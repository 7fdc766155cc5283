"""PyTorch's DDP tutorial in its ``mp.spawn`` form, written for CUDA. Not a line of it knows comm.

    python examples/cuda_spawn_trainer.py                               # on a CUDA machine
    python -m comm --simulate npu examples/cuda_spawn_trainer.py        # two simulated NPUs
    python -m comm examples/cuda_spawn_trainer.py                       # a CPU-only machine (gloo)

The ranks are fresh interpreters started by ``torch.multiprocessing.spawn``; under
``python -m comm`` they run in the drop-in mode too.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2
STEPS = 4
LEARNING_RATE = 0.01


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return ToyModel()


def batch(step: int, rank: int):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(20, 10, generator=generator), torch.randn(20, 5, generator=generator)


def setup(rank: int, world_size: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def demo_basic(rank: int, world_size: int) -> None:
    setup(rank, world_size)
    torch.cuda.set_device(rank)
    model = make_model().to(rank)
    ddp_model = DDP(model, device_ids=[rank])
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LEARNING_RATE)
    for step in range(STEPS):
        inputs, labels = batch(step, rank)
        outputs = ddp_model(inputs.to(rank))
        loss = loss_fn(outputs, labels.to(rank))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sys.stdout.write(f"rank {rank}: step {step} loss {loss.item():.8f} on {outputs.device} "
                         f"backend {dist.get_backend()}\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    print(f"{torch.cuda.device_count()} GPUs; spawning {WORLD_SIZE} ranks", flush=True)
    mp.spawn(demo_basic, args=(WORLD_SIZE,), nprocs=WORLD_SIZE, join=True)
