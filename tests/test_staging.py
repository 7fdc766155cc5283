"""comm.staging: where a tensor goes when the group's backend does not serve its device."""

import pytest
import torch
import torch.distributed as dist

import comm

from multiproc import NPU, file_store, run_ranks


def _staging_on_simulated_npu(rank, world_size):
    comm.init_process_group(store=file_store(world_size), rank=rank, world_size=world_size)
    gloo = dist.new_group([0, 1], backend="gloo")
    npu = torch.ones(2, device="npu")
    return {
        "cpu_on_hccl": str(comm.staging_device(torch.ones(2))),
        "npu_on_hccl": comm.staging_device(npu),
        "cpu_on_gloo": comm.staging_device(torch.ones(2), gloo),
        "npu_on_gloo": str(comm.staging_device(npu, gloo)),
    }


def test_staging_device_on_simulated_npu():
    for rank, seen in enumerate(run_ranks(_staging_on_simulated_npu, 2, backend=None, simulate=NPU)):
        assert seen["cpu_on_hccl"] == f"npu:{rank}"
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
