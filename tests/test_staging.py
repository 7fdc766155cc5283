"""comm.staging: where a tensor goes when the group's backend does not serve its device."""

import threading

import pytest
import torch
import torch.distributed as dist

import comm

from multiproc import NPU, file_store, run_ranks


def _staging_on_simulated_npu(rank, world_size):
    comm.init_process_group(store=file_store(world_size), rank=rank, world_size=world_size)
    gloo = dist.new_group([0, 1], backend="gloo")
    npu = torch.ones(2, device="npu")
    from_a_thread = []
    worker = threading.Thread(target=lambda: from_a_thread.append(str(comm.staging_device(torch.ones(2)))))
    worker.start()
    worker.join()
    return {
        "from_a_thread": from_a_thread[0],  # a new thread's current device is npu:0; the rank's is its own
        "cpu_on_hccl": str(comm.staging_device(torch.ones(2))),
        "npu_on_hccl": comm.staging_device(npu),
        "cpu_on_gloo": comm.staging_device(torch.ones(2), gloo),
        "npu_on_gloo": str(comm.staging_device(npu, gloo)),
    }


def test_staging_device_on_simulated_npu():
    for rank, seen in enumerate(run_ranks(_staging_on_simulated_npu, 2, backend=None, simulate=NPU)):
        assert seen["cpu_on_hccl"] == seen["from_a_thread"] == f"npu:{rank}"
        assert seen["npu_on_hccl"] is None
        assert seen["cpu_on_gloo"] is None
        assert seen["npu_on_gloo"] == "cpu"


def _unbound_group(rank, world_size):
    # A group created without device_id stages onto the bound local rank.
    from multiproc import init_group

    init_group("hccl", rank, world_size)
    return str(dist.group.WORLD.bound_device_id), str(comm.staging_device(torch.ones(1)))


def test_staging_device_without_bound_group():
    for rank, (bound, target) in enumerate(run_ranks(_unbound_group, 2, backend=None, simulate=NPU)):
        assert bound == "None"
        assert target == f"npu:{rank}"


def test_staging_device_rejects_non_tensors():
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        comm.staging_device([1.0])


def _device_ops(call):
    """The operators ``call`` runs on simulated-device tensors, by name, counted."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            if any(t.device.type == "npu" for t in tensors):
                seen[str(func.overloadpacket)] += 1
            return out

    with Record():
        call()
    return seen


def _by_hand_and_through_comm(rank, world_size):
    """What the fix comm replaces issues on the device (copy in, collective, copy back), against comm."""
    device = comm.current_device()
    x, out, outs = torch.ones(5), torch.zeros(5 * world_size), [torch.zeros(5) for _ in range(world_size)]

    def all_reduce():
        staged = x.to(device)
        dist.all_reduce(staged)
        x.copy_(staged)

    def broadcast():
        staged = x.to(device) if rank == 0 else torch.empty(5, device=device)
        dist.broadcast(staged, src=0)
        if rank != 0:
            x.copy_(staged)

    def all_gather_into_tensor():
        staged = torch.empty(out.shape, device=device)
        dist.all_gather_into_tensor(staged, x.to(device))
        out.copy_(staged)

    def all_gather():  # one transfer back, then pieces cut on the host
        staged = torch.empty(5 * world_size, device=device)
        dist.all_gather_into_tensor(staged, x.to(device))
        for target, piece in zip(outs, staged.cpu().chunk(world_size)):
            target.copy_(piece)

    cases = {
        "all_reduce": (all_reduce, lambda: comm.all_reduce(x)),
        "broadcast": (broadcast, lambda: comm.broadcast(x, src=0)),
        "all_gather_into_tensor": (all_gather_into_tensor, lambda: comm.all_gather_into_tensor(out, x)),
        "all_gather": (all_gather, lambda: comm.all_gather(outs, x)),
    }
    comm.all_reduce(torch.ones(1))  # resolve the group first: the first call looks it up once
    return {name: (_device_ops(by_hand), _device_ops(through_comm)) for name, (by_hand, through_comm) in cases.items()}


def test_a_staged_call_issues_no_device_operation_the_hand_written_fix_does_not():
    for seen in run_ranks(_by_hand_and_through_comm, 2, backend="hccl", simulate=NPU):
        for name, (by_hand, through_comm) in seen.items():
            assert sum(by_hand.values()) > 0, name
            extra = through_comm - by_hand
            assert not extra, f"{name}: comm also runs {dict(extra)} on the device (by hand: {dict(by_hand)})"
