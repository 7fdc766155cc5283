"""comm.testing: the simulated accelerator behaves like the real one, errors included."""

import pytest
import torch
import torch.distributed as dist

import comm
import comm.testing

from multiproc import NPU, SEED_ERROR, run_ranks


def _tensors_and_collectives(rank, world_size):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    data = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    on_npu = data.to(f"npu:{rank}")
    seen = {
        "device": str(on_npu.device),
        "roundtrip": torch.equal(on_npu.cpu(), data),
        "cpu_type": type(on_npu.to("cpu")) is torch.Tensor,
        "arithmetic": torch.equal((on_npu * 2 + 1).sum(0).cpu(), (data * 2 + 1).sum(0)),
        "view_writes_through": None,
        "accelerator": str(torch.accelerator.current_accelerator()),
        "default_for_npu": dist.get_default_backend_for_device("npu"),
        "repr": repr(torch.ones(1, device="npu")),
    }
    column = on_npu[:, 1]
    column.add_(100)
    seen["view_writes_through"] = torch.equal(on_npu.cpu()[:, 1], data[:, 1] + 100)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        on_npu + data
    seen["cpu_scalar_mixes"] = torch.equal((on_npu * torch.tensor(2.0)).cpu(), on_npu.cpu() * 2)

    total = torch.full((4,), float(rank + 1), device="npu")
    dist.all_reduce(total)
    seen["all_reduce"] = total.cpu()
    with pytest.raises(RuntimeError) as failure:
        dist.all_reduce(torch.ones(4))
    seen["seed_error"] = str(failure.value)
    mesh = init_device_mesh("npu", (world_size,))
    seen["mesh_device"] = mesh.device_type
    seen["functional"] = funcol.all_reduce(torch.ones(2, device="npu"), "sum", mesh).cpu()
    return seen


def test_simulated_npu_behaves_like_a_device():
    for rank, seen in enumerate(run_ranks(_tensors_and_collectives, 2, backend="hccl", simulate=NPU)):
        assert seen["device"] == f"npu:{rank}"
        assert seen["roundtrip"] and seen["cpu_type"] and seen["arithmetic"]
        assert seen["view_writes_through"] and seen["cpu_scalar_mixes"]
        assert seen["accelerator"] == "npu"
        assert seen["default_for_npu"] == "hccl"
        assert seen["repr"] == f"tensor([1.], device='npu:{rank}')"
        assert torch.equal(seen["all_reduce"], torch.full((4,), 3.0))
        assert seen["seed_error"] == SEED_ERROR  # the first seed's exact error, on CPU
        assert seen["mesh_device"] == "npu"
        assert torch.equal(seen["functional"], torch.full((2,), 2.0))


def _setup_rules(rank, world_size):
    comm.testing.simulate_accelerator(**NPU)  # same arguments again: nothing to do
    with pytest.raises(RuntimeError, match="already set up"):
        comm.testing.simulate_accelerator("npu", "hccl", device_count=2)
    return comm.testing.simulated_accelerator()


def test_setup_is_idempotent_and_exclusive():
    assert run_ranks(_setup_rules, 1, backend=None, simulate=NPU) == ["npu"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "cuda"}, "name must not be a built-in device type"),
        ({"name": "NPU"}, "name must be a lower-case identifier"),
        ({"backend": "gloo"}, "backend 'gloo' is already registered"),
        ({"device_count": 0}, "device_count must be a positive int"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        comm.testing.simulate_accelerator(**kwargs)
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


def _plugin_owns_privateuse1(rank, world_size):
    torch.utils.rename_privateuse1_backend("foo")  # what a real plugin does at import
    with pytest.raises(RuntimeError, match="PrivateUse1 already belongs to 'foo'"):
        comm.testing.simulate_accelerator()
    return True


def test_refuses_when_a_real_plugin_owns_privateuse1():
    assert run_ranks(_plugin_owns_privateuse1, 1, backend=None) == [True]
