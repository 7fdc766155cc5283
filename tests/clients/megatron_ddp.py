"""Megatron-core's DistributedDataParallel (contiguous gradient buffers), written for CUDA and NCCL.

    torchrun --nproc-per-node 2 megatron_ddp.py

Every rank prints each step's loss (its own half of the batch) and a checksum of the
parameters after the step, which DDP keeps equal on every rank.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from workload import BATCH, STEPS, batch, make_model

LEARNING_RATE = 0.1



def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel()
    rank, size = dist.get_rank(), dist.get_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), make_model().cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(STEPS):
        inputs, targets = batch(step)
        share = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        model.zero_grad_buffer()
        optimizer.zero_grad()  # the last step's .grad views of main_grad, which autograd would add to
        loss = nn.functional.mse_loss(model(inputs[share].cuda()), targets[share].cuda())
        loss.backward()
        model.finish_grad_sync()
        for parameter in model.parameters():
            parameter.grad = parameter.main_grad
        optimizer.step()
        checksum = sum(parameter.double().sum().item() for parameter in model.parameters())
        print(f"rank {rank}: step {step} loss {loss.item():.8f} checksum {checksum:.8f} "
              f"on {inputs[share].cuda().device} ({dist.get_backend()})", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
