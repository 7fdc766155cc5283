"""comm.slot on a real GPU (`make gpu-check`): CPU tensors on an nccl group, by every road, and what staging costs."""

import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.distributed_c10d import _coalescing_manager

import comm

from multiproc import SEED_ERROR

pytestmark = pytest.mark.cuda


def test_cpu_tensors_on_a_real_nccl_group_by_every_road(nccl_group):
    with pytest.raises(RuntimeError, match=SEED_ERROR):
        dist.all_reduce(torch.ones(4))
    assert comm.equip() == {"cpu"}
    values = torch.arange(8.0)
    summed = values.clone()
    dist.all_reduce(summed)  # torch's own call, staged by comm's backend
    assert torch.equal(summed, values) and summed.device.type == "cpu"
    averaged = values.clone()
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)  # run as SUM then divide on the copy
    assert torch.equal(averaged, values)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)  # a CPU model over the nccl group: DDP's reducer and parameter check
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(values.reshape(1, 8)).sum().backward()
    assert torch.equal(model.weight.grad, values.reshape(1, 8).expand(2, 8))
    first, second = values.clone(), values.clone() * 2
    with _coalescing_manager(async_ops=True) as manager:
        dist.all_reduce(first)
        dist.all_reduce(second)
    manager.wait()
    assert torch.equal(first, values) and torch.equal(second, values * 2)
    with tempfile.TemporaryDirectory() as path:
        future = dcp.async_save({"w": values.clone()}, checkpoint_id=path)
        on_device = torch.ones(4, device="cuda")
        while not future.done():  # the training thread keeps using the group
            dist.all_reduce(on_device)
        future.result()
        loaded = {"w": torch.zeros(8)}
        dcp.load(loaded, checkpoint_id=path)
        assert torch.equal(loaded["w"], values)


def test_a_device_mesh_whose_groups_split(nccl_group):
    """Bound to a device, DeviceMesh splits its groups from the default one: comm's backend splits with them."""
    comm.patch()
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "tp"))
        for name in ("dp", "tp"):
            group = mesh.get_group(name)
            assert comm.staged_types(group) == {"cpu"}, name
            tensor = torch.full((3,), 2.0)
            dist.all_reduce(tensor, group=group)
            assert torch.equal(tensor, torch.full((3,), 2.0))
    finally:
        comm.unpatch()


def test_staged_bandwidth_of_a_256_mib_pageable_tensor(nccl_group):
    """A staged all_reduce of 256 MiB of pageable CPU memory against the fix by hand through pinned memory."""
    comm.equip()
    host = torch.ones(1 << 26)  # 256 MiB of float32, pageable
    pinned = torch.empty_like(host).pin_memory()

    def by_hand():
        pinned.copy_(host)
        staged = pinned.to("cuda", non_blocking=True)
        dist.all_reduce(staged)
        pinned.copy_(staged, non_blocking=True)
        torch.cuda.synchronize()
        host.copy_(pinned)

    def through_comm():
        dist.all_reduce(host)
        torch.cuda.synchronize()

    seconds = {}
    for name, call in (("by hand", by_hand), ("comm", through_comm)):
        call()
        start = time.perf_counter()
        for _ in range(5):
            call()
        seconds[name] = (time.perf_counter() - start) / 5
    gigabytes = 2 * host.nbytes / 1e9  # in and back
    rates = {name: gigabytes / s for name, s in seconds.items()}
    print(f"\nstaged all_reduce of 256 MiB pageable: comm {rates['comm']:.1f} GB/s, by hand through pinned memory "
          f"{rates['by hand']:.1f} GB/s, ratio {rates['comm'] / rates['by hand']:.3f} (target >= 0.9)")
    assert torch.equal(host[:4], torch.ones(4))
    assert rates["comm"] >= 0.9 * rates["by hand"]


def _seconds(call, repeats=5):
    """Median wall-clock seconds of ``call()`` followed by a device synchronisation, after one warm-up call."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def test_pipelined_staging_against_the_slowest_of_its_parts(nccl_group):
    """256 MiB staged in 8 MiB chunks (comm's default): copy in, all_reduce and copy back overlap, so the whole takes
    little more than its slowest part alone (target <= x1.2)."""
    comm.equip()
    host = torch.ones(1 << 26)  # 256 MiB of float32, pageable
    pinned = torch.empty_like(host).pin_memory()
    device = torch.empty_like(host, device="cuda")

    def copy_in():
        pinned.copy_(host)
        device.copy_(pinned, non_blocking=True)

    def copy_back():
        pinned.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        host.copy_(pinned)

    parts = {"copy in": _seconds(copy_in), "all_reduce": _seconds(lambda: dist.all_reduce(device)),
             "copy back": _seconds(copy_back)}
    whole = _seconds(lambda: dist.all_reduce(host))
    slowest = max(parts.values())
    print("\npipelined staged all_reduce of 256 MiB: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in parts.items())
          + f"; whole {whole * 1e3:.1f} ms, x{whole / slowest:.2f} of the slowest part (target <= x1.2)")
    assert torch.equal(host[:4], torch.ones(4))
    assert whole <= 1.2 * slowest


def test_get_future_of_a_staged_call_does_not_block(nccl_group):
    """get_future() returns before the staged collective and its write-back end; the future then holds the result."""
    comm.equip()
    host = torch.ones(1 << 26)
    dist.all_reduce(host)  # warm: pinned buffers, the write-back stream
    start = time.perf_counter()
    work = dist.all_reduce(host, async_op=True)
    issued = time.perf_counter()
    future = work.get_future()
    returned = time.perf_counter()
    result = future.wait()[0]
    done = time.perf_counter()
    print(f"\nstaged all_reduce of 256 MiB: issued in {(issued - start) * 1e3:.1f} ms, get_future() returned in "
          f"{(returned - issued) * 1e3:.2f} ms, the future completed after {(done - start) * 1e3:.1f} ms")
    assert result is host and torch.equal(host[:4], torch.ones(4))
    assert returned - issued < 0.1 * (done - start)


def test_is_completed_of_a_staged_call_on_nccl(nccl_group):
    """Polling is_completed() ends with the result written back (NCCL's isSuccess() raises: comm must not ask it)."""
    comm.equip()
    host = torch.arange(1 << 20, dtype=torch.float32)
    work = dist.all_reduce(host, async_op=True)
    while not work.is_completed():
        time.sleep(0.001)
    assert torch.equal(host, torch.arange(1 << 20, dtype=torch.float32) * dist.get_world_size())
