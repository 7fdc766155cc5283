"""comm.slot through the functional collectives: DTensor on CPU-offloaded shards, under comm.patch().

The functional ops' kernels call the group's C++ methods, which c10d routes by
device like every other call: comm registers no kernel of its own.
"""

import functools
import itertools
from typing import List

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch.distributed.tensor", reason="needs DTensor (torch >= 2.5)")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402

import comm
import comm.testing

from multiproc import NPU, SEED_ERROR, run_ranks

FULL = torch.arange(24.0).reshape(4, 6)
FUNCTIONAL = torch.ops._c10d_functional


def _on(local, mesh, placements):
    """A DTensor of FULL's shape whose local tensor stays where it is (as FSDP2's CPU offload leaves it)."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(FULL.shape, FULL.stride(), FULL.dtype))
    return DTensor(local, spec, requires_grad=False)


def _redistributions(rank, world_size, mesh, device):
    """full_tensor(), Shard -> Replicate, Partial -> Replicate and Partial -> Shard of shards on ``device``."""
    shard = FULL.chunk(world_size)[rank].clone().to(device)
    share = (FULL * (rank + 1)).to(device)  # Partial: the pieces add up to FULL * (1 + 2)
    return {
        "full_tensor": lambda: _on(shard, mesh, [Shard(0)]).full_tensor(),
        "shard to replicate": lambda: _on(shard, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local(),
        "partial to replicate": lambda: _on(share, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local(),
        "partial to shard": lambda: _on(share, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local(),
    }


def _expected(name, rank, world_size):
    return FULL.chunk(world_size)[rank] * 3 if name == "partial to shard" else FULL * (3 if "partial" in name else 1)


def _outcome(call):
    try:
        result = call()
    except RuntimeError as error:
        return str(error)
    return result.device.type, result.cpu()


def _functional_ops(rank, world_size, group_name, device):
    """Each functional collective torch's op namespace has, on one tensor (or a list) on ``device``."""
    x = (torch.arange(8.0) * (rank + 1)).to(device)
    splits = [4, 4]
    return {
        "all_reduce": lambda: FUNCTIONAL.all_reduce(x, "sum", group_name),
        "all_reduce avg": lambda: FUNCTIONAL.all_reduce(x, "avg", group_name),
        "all_reduce transposed": lambda: FUNCTIONAL.all_reduce(x.reshape(2, 4).t(), "sum", group_name),
        "all_reduce_": lambda: FUNCTIONAL.all_reduce_(x.clone(), "max", group_name),
        "all_reduce_coalesced": lambda: FUNCTIONAL.all_reduce_coalesced([x, x * 2], "sum", group_name),
        "all_gather_into_tensor": lambda: FUNCTIONAL.all_gather_into_tensor(x, world_size, group_name),
        "all_gather_into_tensor_coalesced": lambda: FUNCTIONAL.all_gather_into_tensor_coalesced(
            [x, x + 1], world_size, group_name),
        "reduce_scatter_tensor": lambda: FUNCTIONAL.reduce_scatter_tensor(x, "sum", world_size, group_name),
        "reduce_scatter_tensor_coalesced": lambda: FUNCTIONAL.reduce_scatter_tensor_coalesced(
            [x, x * 3], "sum", world_size, group_name),
        "all_to_all_single": lambda: FUNCTIONAL.all_to_all_single(x, splits, splits, group_name),
        "broadcast": lambda: FUNCTIONAL.broadcast(x, 1, group_name),
        "broadcast_": lambda: FUNCTIONAL.broadcast_(x.clone(), 0, group_name),
    }


def _waited(result):
    """What the functional op gave, once waited for: (device type, strides, value on the CPU) per output."""
    results = result if isinstance(result, list) else [result]
    return [(r.device.type, r.stride(), FUNCTIONAL.wait_tensor(r).cpu()) for r in results]


def _offloaded_on_simulated_npu(rank, world_size):
    import torch.distributed._functional_collectives as funcol

    mesh = init_device_mesh("npu", (world_size,))
    seen = {"npu": {}, "torch": {}, "patched": {}, "functional": {}}
    for name, call in _redistributions(rank, world_size, mesh, f"npu:{rank}").items():
        seen["npu"][name] = _outcome(call)
    for name, call in _redistributions(rank, world_size, mesh, "cpu").items():
        seen["torch"][name] = _outcome(call)
    group_name = mesh.get_group().group_name
    kernels = torch._C._dispatch_dump("_c10d_functional::all_reduce")
    with comm.patched():
        seen["staged"] = sorted(comm.staged_types(mesh.get_group()))
        for name, call in _redistributions(rank, world_size, mesh, "cpu").items():
            seen["patched"][name] = _outcome(call)
        npu_ops = _functional_ops(rank, world_size, group_name, f"npu:{rank}")
        for name, call in _functional_ops(rank, world_size, group_name, "cpu").items():
            seen["functional"][name] = (_waited(call()), _waited(npu_ops[name]()))
        # funcol's own wrapper: an AsyncCollectiveTensor that waits on first use
        waiting = funcol.all_reduce(torch.ones(3) * (rank + 1), "sum", mesh)
        seen["async"] = (type(waiting).__name__, (waiting + 0).tolist())
        # torchtitan's clip: torch's get_total_norm over offloaded gradient shards, then full_tensor()
        grads = [_on(g.chunk(world_size)[rank].clone(), mesh, [Shard(0)]) for g in (FULL, FULL.T.contiguous())]
        seen["norm"] = torch.nn.utils.get_total_norm(grads).full_tensor().item()
    seen["kernels unchanged"] = torch._C._dispatch_dump("_c10d_functional::all_reduce") == kernels
    return seen


def test_offloaded_shards_redistribute_under_the_patch_on_simulated_npu():
    for rank, seen in enumerate(run_ranks(_offloaded_on_simulated_npu, 2, backend="hccl", simulate=NPU)):
        assert seen["staged"] == ["cpu"] and seen["kernels unchanged"]
        for name, (npu_device, npu_value) in seen["npu"].items():
            assert npu_device == "npu" and torch.equal(npu_value, _expected(name, rank, 2)), name  # as on hardware
            assert seen["torch"][name] == SEED_ERROR, name  # torch alone: the second seed
            device, value = seen["patched"][name]
            assert device == "cpu" and torch.equal(value, npu_value), name  # CPU in, CPU out, the same values
        for name, (on_cpu, on_npu) in seen["functional"].items():
            assert [d for d, _, _ in on_cpu] == ["cpu"] * len(on_cpu), name
            assert [s for _, s, _ in on_cpu] == [s for _, s, _ in on_npu], name  # torch's layout
            assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(on_cpu, on_npu)), name
        assert seen["async"] == ("AsyncCollectiveTensor", [3.0, 3.0, 3.0])
        reference = torch.nn.utils.get_total_norm([FULL, FULL.T.contiguous()]).item()
        assert seen["norm"] == pytest.approx(reference, rel=1e-6)


PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial()]


def _start(full, mesh, placements, rank):
    """A DTensor holding ``full`` in ``placements``: Partial pieces are rank-dependent and add up to it."""
    if not any(p.is_partial() for p in placements):
        return distribute_tensor(full, mesh, placements)
    sharded = distribute_tensor(full, mesh, [Replicate() if p.is_partial() else p for p in placements])
    parts = mesh.size(placements.index(Partial()))
    weight = 1.0 / parts if rank % 2 else (2.0 - 1.0 / parts) if parts == 2 else 1.0 / parts
    return DTensor.from_local(sharded.to_local() * weight, mesh, placements, run_check=False)


def _matrix(rank, mesh):
    """Every redistribution between the placements of PLACEMENTS on ``mesh``: the local results, in order."""
    full = torch.arange(48.0, dtype=torch.float64).reshape(6, 8)
    combos = list(itertools.product(PLACEMENTS, repeat=mesh.ndim))
    results = []
    for source in combos:
        if sum(p.is_partial() for p in source) > 1:
            continue
        for target in combos:
            if any(p.is_partial() for p in target):
                continue
            results.append(_start(full, mesh, list(source), rank).redistribute(mesh, list(target)).to_local())
    return results


def _matrix_with_and_without_the_patch(rank, world_size):
    meshes = [init_device_mesh("cpu", (world_size,)), init_device_mesh("cpu", (2, world_size // 2))]
    plain = [_matrix(rank, mesh) for mesh in meshes]
    with comm.patched():
        patched = [_matrix(rank, mesh) for mesh in meshes]
    return plain, patched


def test_dtensor_redistributions_on_gloo_are_bit_identical_under_the_patch():
    for plain, patched in run_ranks(_matrix_with_and_without_the_patch, 4, timeout=300):
        assert [len(m) for m in plain] == [len(m) for m in patched] and sum(len(m) for m in plain) > 100
        for ours, theirs in zip(itertools.chain(*patched), itertools.chain(*plain)):
            assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype


def _all_reduce_then_wait(tensor: torch.Tensor, group_name: str, issued: List[bool]) -> None:
    """A functional all_reduce of ``tensor``, then wait_tensor on its result.

    ``issued`` records that issuing returned: the failure is for wait_tensor to report.
    """
    pending = FUNCTIONAL.all_reduce(tensor, "sum", group_name)
    issued.append(True)
    FUNCTIONAL.wait_tensor(pending)


def _failure_reaches_wait_tensor(rank, world_size):
    """A staged functional collective whose backend fails: wait_tensor raises, nothing is silently wrong."""
    from faults import failure_problems

    with comm.patched():
        group = dist.new_group([0, 1])  # serves only the NPU: comm stages its CPU tensors
        seen = {"staged": sorted(comm.staged_types(group)), "issued": []}
        tensor = torch.ones(3)
        call = functools.partial(_all_reduce_then_wait, tensor, group.group_name, seen["issued"])
        seen["problems"] = failure_problems("all_reduce", call, [tensor], group, "fail_wait")
        seen["next"] = FUNCTIONAL.wait_tensor(FUNCTIONAL.all_reduce(torch.ones(3), "sum", group.group_name)).tolist()
    return seen


def test_a_failed_staged_functional_collective_raises_on_wait_tensor():
    for seen in run_ranks(_failure_reaches_wait_tensor, 2, backend="hccl", simulate=NPU):
        assert seen["staged"] == ["cpu"]
        assert seen["issued"] == [True]  # the failure came from wait_tensor, not from issuing the collective
        assert seen["problems"] == []
        assert seen["next"] == [2.0, 2.0, 2.0]
