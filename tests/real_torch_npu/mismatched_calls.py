"""Calls that do not match: rank 0 all-reduces 4 elements where rank 1 all-reduces 8.

On hardware HCCL waits for a matching call until its timeout; either way the job must end with an
error, never hang. Rank 0 prints how long it ran if it is still running a minute later.
"""

import os
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.npu.set_device(rank)
dist.init_process_group("hccl")
start = time.monotonic()
x = torch.ones(4 if rank == 0 else 8, device="npu")
dist.all_reduce(x)
torch.npu.synchronize()
time.sleep(60)  # the watchdog ends the process well before this
os.write(1, f"rank {rank} still running {time.monotonic() - start:.1f} s after calls that do not match\n".encode())
