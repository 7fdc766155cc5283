"""Train a small model with DDP; no line of it names a device or a backend.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py [--simulate npu]
    torchrun --nnodes 2 --nproc-per-node 1 ... examples/train_ddp.py --simulate npu

Unchanged, it runs on CUDA (nccl), Ascend (hccl), XPU (xccl), the simulated NPU
or the CPU (gloo).
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import comm
import comm.testing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", metavar="DEVICE", help="simulate an accelerator (e.g. npu) on a CPU-only machine")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.simulate:
        comm.testing.simulate_accelerator(args.simulate)

    device = comm.init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(args.steps):
        inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        targets = inputs.sum(dim=1, keepdim=True).tanh()
        loss = nn.functional.mse_loss(ddp(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        comm.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
    final = loss.detach().cpu()
    comm.all_reduce(final, op=dist.ReduceOp.AVG)  # a CPU tensor on any group
    comm.empty_cache()
    sys.stdout.write(f"rank {rank}/{world_size}: device={device} backend={dist.get_backend()} "
                     f"final loss {final.item():.6f}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
