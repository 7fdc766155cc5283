"""Two gloo ranks; each issues a collective during backward and drops its handle, then exits holding the lock.

Run by tests/test_interpreter_exit.py under torchrun, plainly and under ``-m comm``.
Rank 1 joins the collective half a second late, so on rank 0 the collective ends
while the main thread holds the interpreter lock and never lets it go (a switch
interval of 100 s; no write, no sleep): gloo's worker thread, holding the last
reference to the work, waits for the lock until the interpreter finalizes.
On torch 2.13 every plain run aborts so; on 2.15.0 about one in three does (4 of 12 here):
something there hands the lock over first in the others.
"""

import sys
import time

import torch
import torch.distributed as dist

REDUCED = torch.ones(4)


class ReduceInBackward(torch.autograd.Function):
    """Identity forward; its backward starts an all_reduce of REDUCED and does not wait for it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(REDUCED, async_op=True)  # the handle is dropped: gloo's worker holds the last reference
        return grad


dist.init_process_group("gloo")
x = torch.zeros(4, requires_grad=True)
if dist.get_rank() == 1:
    time.sleep(0.5)
sys.setswitchinterval(100)
ReduceInBackward.apply(x).sum().backward()
deadline = time.monotonic() + 60
while REDUCED[0].item() != 2.0 and time.monotonic() < deadline:
    pass
assert REDUCED[0].item() == 2.0, "the collective did not complete"  # no print: a write hands the lock over
