"""A peer that dies: rank 1 exits after one all_reduce; rank 0's next all_reduce must end, never hang.

torch_npu's watchdog reads the communicator's asynchronous error (the fake's HCCL sets it when a
peer process has exited) and takes the process down. Rank 0 prints how long it waited.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.npu.set_device(rank)
dist.init_process_group("hccl", timeout=datetime.timedelta(seconds=20))
x = torch.ones(4, device="npu")
dist.all_reduce(x)
torch.npu.synchronize()
if rank == 1:
    os._exit(0)
start = time.monotonic()
dist.all_reduce(x)
torch.npu.synchronize()
time.sleep(60)  # the watchdog ends the process well before this
os.write(1, f"rank 0 still running {time.monotonic() - start:.1f} s after its peer died\n".encode())
