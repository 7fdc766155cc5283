"""Back-to-back staged broadcasts from one source, on two ranks over the fake CANN.

Rank 1 broadcasts ten CPU tensors, each with new values, without waiting in between (a source
waits for nothing). Each is staged onto its NPU: had comm handed a call's device buffer back to
the allocator before the collective read it, the next call's copy would overwrite it and rank 0
would receive later values. Rank 0 prints ``right`` or the calls it got wrong.
"""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.npu.set_device(rank)
dist.init_process_group("hccl")
wrong = []
for call in range(10):
    values = torch.arange(1000, dtype=torch.int64) + 100 * call
    received = values.clone() if rank == 1 else torch.zeros(1000, dtype=torch.int64)
    dist.broadcast(received, src=1)
    if not torch.equal(received, values):
        wrong.append(f"call {call} got {received[:2].tolist()}")
if rank == 0:
    os.write(1, (("wrong " + "; ".join(wrong)) if wrong else "right").encode() + b"\n")
dist.destroy_process_group()
