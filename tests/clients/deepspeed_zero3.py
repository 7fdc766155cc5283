"""DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to the CPU, written for CUDA as its docs write it.

    torchrun --nproc-per-node 2 deepspeed_zero3.py

DeepSpeed picks its accelerator and backend itself. Every rank prints each step's
loss (its own half of the batch) and the global gradient norm DeepSpeed clips with.
"""

import os

import deepspeed
import torch
import torch.nn as nn

from workload import BATCH, STEPS, batch, make_model

CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH // 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
    "zero_force_ds_cpu_optimizer": False,  # torch's AdamW: DeepSpeedCPUAdam would compile a C++ op first
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}



def main() -> None:
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    engine, _, _, _ = deepspeed.initialize(model=make_model(), config=CONFIG)
    rank, size = engine.global_rank, engine.world_size
    for step in range(STEPS):
        inputs, targets = batch(step)
        share = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        loss = nn.functional.mse_loss(engine(inputs[share].to(engine.device)), targets[share].to(engine.device))
        engine.backward(loss)
        engine.step()
        print(f"rank {rank}: step {step} loss {loss.item():.8f} grad_norm {engine.get_global_grad_norm():.8f} "
              f"on {engine.device}", flush=True)


if __name__ == "__main__":
    main()
