"""comm.backend: default backend per accelerator, and the device types a group serves."""

import pytest
import torch
import torch.distributed as dist

import comm
from comm.groups import backend_string_device_types

from multiproc import NPU, file_store, init_group, run_ranks


def test_default_backend_cpu_and_mps():
    assert comm.default_backend() == "gloo"  # this process has no accelerator
    assert comm.default_backend("cpu") == "gloo"
    assert comm.default_backend("mps") == "gloo"


def test_default_backend_cuda_is_capability_aware(monkeypatch):
    # Whether the build has NCCL: stub the build probe, the narrowest seam there is.
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert comm.default_backend("cuda") == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert comm.default_backend("cuda") == "nccl"


def test_default_backend_xpu(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # never used for xpu
    with pytest.raises(RuntimeError, match="no collective backend available for device type 'xpu'"):
        comm.default_backend("xpu")
    monkeypatch.setattr(dist, "is_ccl_available", lambda: True, raising=False)
    assert comm.default_backend("xpu") == "ccl"
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True, raising=False)  # torch < 2.8 lacks xccl
    assert comm.default_backend("xpu") == "xccl"


def test_default_backend_unknown_device():
    with pytest.raises(RuntimeError, match="device type 'tpu'"):
        comm.default_backend("tpu")
    with pytest.raises(ValueError, match="device_type must be a device type string"):
        comm.default_backend(3)


def test_backend_strings():
    assert backend_string_device_types("gloo") == {"cpu", "cuda"}
    assert backend_string_device_types("nccl") == {"cuda"}
    assert backend_string_device_types("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert backend_string_device_types("xccl") == {"xpu"}


def test_device_types_needs_a_group():
    with pytest.raises(RuntimeError, match="default process group is not initialized"):
        comm.device_types()
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        comm.device_types("gloo")


def _gloo_groups(rank, world_size):
    world = comm.device_types()
    subgroup = dist.new_group([0, 1])
    cpu_only = dist.new_group([0, 1], backend="cpu:gloo")
    return {
        "world": sorted(world),
        "new_group": sorted(comm.device_types(subgroup)),
        "composite": sorted(comm.device_types(cpu_only)),
    }


def test_device_types_of_gloo_groups():
    for seen in run_ranks(_gloo_groups, 2):
        assert seen["world"] == ["cpu", "cuda"]
        assert seen["new_group"] == ["cpu", "cuda"]
        assert seen["composite"] == ["cpu"]


def _undefined_backend(rank, world_size):
    init_group(None, rank, world_size)  # no backend named: torch picks per device
    return dist.get_backend(), sorted(comm.device_types())


def test_device_types_of_an_undefined_backend():
    if dist.is_nccl_available():
        pytest.skip("a CUDA build makes nccl half of an undefined-backend group; this checks a CPU build's")
    for backend, types in run_ranks(_undefined_backend, 2, backend=None):
        assert backend == "undefined"
        assert types == ["cpu"]


def _simulated_npu_backends(rank, world_size):
    chosen = comm.default_backend()
    dist.is_nccl_available = lambda: True  # torch_npu's transfer_to_npu does this
    still = comm.default_backend("npu")
    device = comm.init_process_group(store=file_store(world_size), rank=rank, world_size=world_size)
    seen = {
        "default": chosen,
        "with_nccl_alias": still,
        "device": str(device),
        "backend": dist.get_backend(),
        "types": sorted(comm.device_types()),
        "staged": sorted(comm.staged_types()),
        "plugin_capability": dist.Backend.backend_capability["hccl"],
    }
    explicit = dist.new_group([0, 1], backend="gloo")
    seen["explicit_gloo"] = sorted(comm.device_types(explicit))
    return seen


def test_backend_on_simulated_npu():
    for rank, seen in enumerate(run_ranks(_simulated_npu_backends, 2, backend=None, simulate=NPU)):
        assert seen["default"] == "hccl"
        assert seen["with_nccl_alias"] == "hccl"
        assert seen["device"] == f"npu:{rank}"
        assert seen["backend"] == "hccl"
        assert seen["types"] == ["cpu", "npu"] and seen["staged"] == ["cpu"]  # equipped by comm.init_process_group
        assert seen["plugin_capability"] == ["npu"]
        assert seen["explicit_gloo"] == ["cpu", "cuda"]  # made by torch, unpatched: not equipped


def _explicit_backend_wins(rank, world_size):
    device = comm.init_process_group("gloo", store=file_store(world_size), rank=rank, world_size=world_size)
    return str(device), dist.get_backend()


def test_explicit_backend_wins_on_simulated_npu():
    for rank, (device, backend) in enumerate(run_ranks(_explicit_backend_wins, 2, backend=None, simulate=NPU)):
        assert device == f"npu:{rank}"
        assert backend == "gloo"


@pytest.fixture
def no_launcher(launched):
    """A process started by hand: no launcher's variables; yields ``launched``, to set a launcher's later."""
    launched({})
    yield launched
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_single_process_gets_a_group_of_one(no_launcher):
    assert comm.init_process_group() == torch.device("cpu")
    value = torch.tensor([2.5])
    dist.all_reduce(value)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend(), value.item()) == (0, 1, "gloo", 2.5)


def test_what_the_caller_passes_wins_over_the_launcher(no_launcher, tmp_path):
    # srun says rank 5 of 8 and names hosts that do not exist; the caller's store and
    # rank decide, so the node list is never contacted.
    no_launcher({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                 "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_JOB_ID": "4242"})
    comm.init_process_group(store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    dist.destroy_process_group()
    # Under mpirun without MASTER_ADDR an init_method from the caller is all it needs.
    no_launcher({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    comm.init_process_group(init_method=f"file://{tmp_path / 'file_init'}")
    assert (comm.launch_info().launcher, dist.get_rank(), dist.get_world_size()) == ("openmpi", 0, 1)


def test_mpirun_without_master_addr_says_what_to_set(no_launcher):
    no_launcher({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match="MASTER_ADDR is not set, so comm cannot tell where rank 0 of this openmpi "
                                         "launch listens; expected MASTER_ADDR"):
        comm.init_process_group()
    assert not dist.is_initialized()
