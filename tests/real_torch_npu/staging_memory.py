"""The device memory comm's staging takes, as torch_npu's own caching allocator counts it, over the fake CANN.

Run under comm on two ranks, on a device of COMM_FAKE_CANN_MEMORY bytes (the fake's capacity, which its
aclrtMalloc respects and aclrtGetMemInfo reports). Rank 0 prints one line per measure, ``name value``:

* ``peak <MiB> staged|by_hand <bytes>``: the allocated peak (torch.npu.max_memory_allocated) one staged all_reduce of
  a CPU tensor, or the fix by hand of it, took beyond what was allocated before;
* ``by_hand_1GiB <error>``: what copying a 1 GiB CPU tensor onto the device raised (torch_npu's own error);
* ``staged_1GiB right|wrong``: the staged all_reduce of it;
* ``varied staged|by_hand <calls> <largest> <peak reserved after 100> <peak reserved> <allocated> <peak allocated>``:
  the largest tensor's bytes, max_memory_reserved after 100 calls and after all, memory_allocated, and
  max_memory_allocated over all of them, over all_reduces of varied sizes staged or by hand;
* ``reserved_after_empty_cache <bytes>``.
"""

import functools
import os

import torch
import torch.distributed as dist

MiB = 1 << 20
rank = int(os.environ["RANK"])
torch.npu.set_device(rank)
dist.init_process_group("hccl")
world = dist.get_world_size()
total = float(sum(range(1, world + 1)))


def report(*words):
    if rank == 0:
        os.write(1, (" ".join(str(word) for word in words) + "\n").encode())


def peak_of(run):
    torch.npu.synchronize()
    torch.npu.reset_peak_memory_stats()
    before = torch.npu.memory_allocated()
    run()
    torch.npu.synchronize()
    return torch.npu.max_memory_allocated() - before


def by_hand(tensor):
    staged = tensor.to("npu")
    dist.all_reduce(staged)
    tensor.copy_(staged)


dist.barrier()  # HCCL's communicator takes its buffer before anything is measured
for size in (4, 16, 64, 256):
    tensor = torch.full((size * MiB // 4,), float(rank + 1))
    report("peak", size, "staged", peak_of(functools.partial(dist.all_reduce, tensor)))
    if not torch.all(tensor == total):
        report("wrong", size)
    tensor = torch.full((size * MiB // 4,), float(rank + 1))
    report("peak", size, "by_hand", peak_of(functools.partial(by_hand, tensor)))
    del tensor
torch.npu.empty_cache()

tensor = torch.full(((1 << 30) // 4,), float(rank + 1))
try:
    tensor.to("npu")
    report("by_hand_1GiB", "copied")
except RuntimeError as error:
    report("by_hand_1GiB", type(error).__name__, str(error).splitlines()[0][:120])
dist.all_reduce(tensor)
report("staged_1GiB", "right" if torch.all(tensor == total) else "wrong")
del tensor
torch.npu.empty_cache()

# All-reduces of varied sizes, from 64 KiB to 24 MiB, staged and then by hand, each from an emptied cache: what the
# allocator keeps reserved after the first hundred calls and after all of them.
calls = int(os.environ.get("VARIED_CALLS", "500"))
for way, reduce in (("staged", dist.all_reduce), ("by_hand", by_hand)):
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats()
    generator = torch.Generator().manual_seed(0)
    largest, early = 0, 0
    for call in range(calls):
        numel = int(torch.randint(16 << 10, 6 << 20, (1,), generator=generator))
        largest = max(largest, numel * 4)
        tensor = torch.ones(numel)
        reduce(tensor)
        if call == 99:
            early = torch.npu.max_memory_reserved()
    report("varied", way, calls, largest, early, torch.npu.max_memory_reserved(), torch.npu.memory_allocated(),
           torch.npu.max_memory_allocated())
torch.npu.empty_cache()
report("reserved_after_empty_cache", torch.npu.memory_reserved())
dist.destroy_process_group()
