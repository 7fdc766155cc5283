"""Accelerate's FSDP2 with CPU offload, clipping each step's gradients with ``accelerator.clip_grad_norm_``.

    torchrun --nproc-per-node 2 accelerate_fsdp2_clip.py

The offloaded gradients lie on the CPU while the group is the accelerator's, which is
where clipping meets a backend that serves no CPU. Every rank prints each step's
loss (its own half of the batch) and the global norm before clipping.
"""

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from workload import BATCH, STEPS, batch, make_model


def main() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True, reshard_after_forward=True)
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank, size = accelerator.process_index, accelerator.num_processes
    for step in range(STEPS):
        inputs, targets = batch(step)
        share = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        inputs, targets = inputs[share].to(accelerator.device), targets[share].to(accelerator.device)
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {rank}: step {step} loss {loss.item():.8f} grad_norm {float(norm):.8f} "
              f"on {accelerator.device.type} ({accelerator.state.backend})", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
