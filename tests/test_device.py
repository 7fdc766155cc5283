"""comm.device: accelerator detection, per-rank binding, cache release."""

import types

import pytest
import torch

import comm
from comm import device as comm_device

from multiproc import NPU, run_ranks


def test_probe_order_without_torch_accelerator(monkeypatch):
    # A CUDA or XPU build's probes cannot be simulated: stub them at the probe itself.
    assert comm_device._probe_accelerator() == "cpu"
    if not hasattr(torch, "xpu"):  # torch < 2.3 has no xpu module at all
        monkeypatch.setattr(torch, "xpu", types.SimpleNamespace(), raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True, raising=False)
    assert comm_device._probe_accelerator() == "xpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert comm_device._probe_accelerator() == "cuda"


@pytest.mark.skipif(not hasattr(torch, "accelerator"), reason="torch.accelerator arrived in torch 2.6")
def test_a_cuda_build_without_a_gpu_is_a_cpu_process(monkeypatch):
    # What a CUDA wheel reports on a CPU-only machine: torch was built for cuda (the
    # compile-time answer, stubbed on this CPU build), and CUDA is not available.
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    assert not torch.cuda.is_available()
    assert comm.accelerator_type() == "cpu"
    assert comm.bind(1) == torch.device("cpu")


def test_cpu_only_process():
    assert comm.accelerator_type() == "cpu"
    assert comm.bind() == torch.device("cpu")
    assert comm.bind(3) == torch.device("cpu")
    comm.empty_cache("cpu")  # documented no-op: no allocator to release


@pytest.mark.parametrize(
    "value, message",
    [("tpu", "COMM_DEVICE='tpu' names a device type that is not available"), ("cuda:0", "bare device type"),
     ("CPU", "bare device type"), ("cuda", "not available"), ("npu", "not available")],
)
def test_override_must_name_an_available_type(monkeypatch, value, message):
    monkeypatch.setenv("COMM_DEVICE", value)
    with pytest.raises(ValueError, match=message):
        comm.accelerator_type()


def test_override_wins(monkeypatch):
    monkeypatch.setenv("COMM_DEVICE", "cpu")
    assert comm.accelerator_type() == "cpu"


def test_local_rank_must_be_an_integer(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "abc")
    with pytest.raises(ValueError, match="LOCAL_RANK='abc'"):
        comm.bind()
    with pytest.raises(ValueError, match="local_rank must be a non-negative int"):
        comm.bind(-1)


def _simulated_npu_scenario(rank, world_size):
    import os

    from comm.device import _probe_accelerator

    seen = {
        "accelerator": comm.accelerator_type(),
        "probe": _probe_accelerator(),
        "bound": str(comm.bind()),  # LOCAL_RANK from the environment
        "current_index": torch.npu.current_device(),
        "new_tensor": str(torch.ones(2, device="npu").device),
    }
    with pytest.raises(ValueError, match="local_rank 8 is out of range: this process sees 8 npu"):
        comm.bind(8)
    os.environ["COMM_DEVICE"] = "cpu"
    seen["override"] = comm.accelerator_type()
    del os.environ["COMM_DEVICE"]
    torch.xpu.is_available = lambda: True  # npu is probed before xpu
    seen["probe_with_xpu"] = _probe_accelerator()
    torch.cuda.is_available = lambda: True  # cuda before everything
    seen["probe_with_cuda"] = _probe_accelerator()

    other = 1 - rank
    block = torch.zeros(1024, device=f"npu:{other}")
    seen["reserved_other_before"] = torch.npu.memory_reserved(other)
    seen["reserved_own_before"] = torch.npu.memory_reserved(rank)
    device = block.device
    del block  # a block in use stays reserved through empty_cache, as torch_npu's
    comm.empty_cache(device)
    seen["reserved_other_after"] = torch.npu.memory_reserved(other)
    seen["reserved_own_after"] = torch.npu.memory_reserved(rank)
    seen["still_bound"] = torch.npu.current_device()
    comm.empty_cache()
    seen["reserved_own_after_default"] = torch.npu.memory_reserved(rank)
    return seen


def test_binding_and_cache_on_simulated_npu():
    results = run_ranks(_simulated_npu_scenario, 2, backend=None, simulate=NPU)
    for rank, seen in enumerate(results):
        assert seen["accelerator"] == "npu"
        assert seen["probe"] == "npu"
        assert seen["bound"] == f"npu:{rank}"
        assert seen["current_index"] == rank
        assert seen["new_tensor"] == f"npu:{rank}"
        assert seen["override"] == "cpu"
        assert seen["probe_with_xpu"] == "npu"
        assert seen["probe_with_cuda"] == "cuda"
        # The release went to the tensor's own device, not the bound one.
        assert seen["reserved_other_before"] >= 1024 * 4
        assert seen["reserved_other_after"] == 0
        assert seen["reserved_own_after"] == seen["reserved_own_before"] > 0
        assert seen["still_bound"] == rank
        assert seen["reserved_own_after_default"] == 0
