"""comm.slot: comm's backend in the device slots a group leaves empty, reached by every road into c10d.

And where it stages: ``comm.staging_device``, and the device operations a staged call issues.

Each road is tried on two simulated NPUs, first without comm (it must fail as it
does on real hardware), then with the group equipped by ``comm.patch()`` after the
group exists and, for a second group, before it does; values are compared with the
same call on NPU-resident tensors, which the group's own backend serves.
"""

import os
import threading
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.distributed_c10d as c10d
from torch.distributed.distributed_c10d import _coalescing_manager

import comm
import comm.slot

from multiproc import NPU, SEED_ERROR, error_of, file_store, in_one_rank, init_group, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))


def _values(rank, device, numel=6):
    return (torch.arange(numel, dtype=torch.float32) * (rank + 1)).to(device)


def _ddp_gradient(model_device, rank, group):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(model_device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    ddp(_values(rank, model_device).reshape(1, 6)).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()


def _coalesced(device, rank, group, async_ops):
    tensors = [_values(rank, device), _values(rank + 2, device, 3)]
    with _coalescing_manager(group, async_ops=async_ops) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor, group=group)
    if async_ops:
        manager.wait()
    return [t.cpu() for t in tensors]


def _all_gather_coalesced(device, rank, group):
    inputs = [_values(rank, device), _values(rank, device, 2)]
    outputs = [[torch.zeros_like(t) for t in inputs] for _ in range(2)]  # one list per rank
    dist.all_gather_coalesced(outputs, inputs, group=group)
    return [t.cpu() for lists in outputs for t in lists]


def _roads(rank, group):
    """Every road into c10d, on CPU tensors over ``group``, each with NPU tensors' result beside it."""
    npu = torch.device("npu", rank)
    roads = {}

    def all_reduce(device):
        tensor = _values(rank, device)
        dist.all_reduce(tensor, group=group)
        return [tensor.cpu()]

    def functional(device):
        import torch.distributed._functional_collectives as fc

        return [fc.all_reduce(_values(rank, device), "sum", group).wait().cpu()]

    roads["all_reduce"] = all_reduce
    roads["functional all_reduce"] = functional
    roads["DDP"] = lambda device: [_ddp_gradient(device, rank, group)]
    roads["coalescing manager"] = lambda device: _coalesced(device, rank, group, async_ops=False)
    roads["coalescing manager, async"] = lambda device: _coalesced(device, rank, group, async_ops=True)
    expected = {name: road(npu) for name, road in roads.items()}
    # HCCL has no allgather_coalesced (tests/test_simulated_hccl.py): what it gathers, by hand.
    roads["all_gather_coalesced"] = lambda device: _all_gather_coalesced(device, rank, group)
    expected["all_gather_coalesced"] = [_values(r, "cpu", n) for r in range(2) for n in (6, 2)]
    return {name: (road, expected[name]) for name, road in roads.items()}


def _failures_without_comm(rank, group):
    failures = {}
    for name, (road, _) in _roads(rank, group).items():
        failures[name] = error_of(road, "cpu", catch=(RuntimeError, ValueError))
    return failures


def _differences_with_comm(rank, group):
    differences = []
    for name, (road, expected) in _roads(rank, group).items():
        got = road("cpu")
        if not all(torch.equal(a, b) for a, b in zip(got, expected)) or len(got) != len(expected):
            differences.append(f"{name}: {got} != {expected}")
    tensor = _values(rank, torch.device("npu", rank))  # the group's own calls still work after all of them
    dist.all_reduce(tensor, group=group)
    if not torch.equal(tensor.cpu(), _values(0, "cpu") + _values(1, "cpu")):
        differences.append(f"an NPU all_reduce after them: {tensor.cpu()}")
    return differences


def _every_road(rank, world_size):
    init_group("hccl", rank, world_size, device_id=torch.device("npu", rank))
    world = dist.group.WORLD
    before = _failures_without_comm(rank, world)
    saved = error_of(dcp.async_save, {"w": torch.ones(2)}, catch=(AssertionError,))
    comm.patch()  # after the default group exists
    after_patch = _differences_with_comm(rank, world)
    subgroup = dist.new_group([0, 1])  # made while patched
    in_subgroup = _differences_with_comm(rank, subgroup)
    mesh = torch.distributed.device_mesh.init_device_mesh("npu", (2,))
    in_mesh = _differences_with_comm(rank, mesh.get_group())
    return {
        "before": before, "async_save before": saved, "after patch": after_patch, "subgroup": in_subgroup,
        "mesh": in_mesh, "types": sorted(d.type for d in dist.group.WORLD._device_types),
        "staged": sorted(comm.staged_types()), "backend": dist.get_backend(), "config": dist.get_backend_config(),
        "name": dist.group.WORLD.group_name, "stats": comm.stats(),
    }


def test_every_road_into_c10d_stages_on_simulated_hccl():
    for result in run_ranks(_every_road, backend=None, simulate=NPU, timeout=300):
        assert len(result["before"]) == 6, result["before"]
        assert all(SEED_ERROR in (error or "") for error in result["before"].values()), result["before"]
        assert "A CPU backend must be enabled" in result["async_save before"]
        assert result["after patch"] == [] and result["subgroup"] == [] and result["mesh"] == []
        assert result["types"] == ["cpu", "npu"] and result["staged"] == ["cpu"]
        assert (result["backend"], result["config"]) == ("hccl", "npu:hccl")  # what the group was created with
        assert result["name"] == "0"
        for name in ("all_reduce", "all_reduce_coalesced", "all_gather_coalesced"):
            assert result["stats"][name]["staged_calls"] > 0, result["stats"]


def _late_coalesced_block(rank, world_size):
    """torch's coalescing manager told the CPU: its fast path sends the CPU all-reduces as one
    allreduce_coalesced inside the staging backend's block. Rank 1 comes late, so rank 0's
    results exist only once its wait has waited for the collective itself."""
    import time

    npu = torch.device("npu", rank)
    init_group("hccl", rank, world_size, device_id=npu)
    comm.patch()
    seen = {}
    for count in (2, 3):
        for async_ops in (False, True):
            tensors = [_values(rank + i, "cpu", 4 + i) for i in range(count)]
            if rank == 1:
                time.sleep(0.5)
            with _coalescing_manager(dist.group.WORLD, device=torch.device("cpu"), async_ops=async_ops) as manager:
                for tensor in tensors:
                    dist.all_reduce(tensor)
            if async_ops:
                manager.wait()
            seen[(count, async_ops)] = tensors
    comm.unpatch()
    return seen


def test_a_coalesced_block_of_cpu_all_reduces_waits_for_hccls_own_work():
    """HCCL leaves a plain all-reduce out of its coalescing block (its endCoalescing returns
    nothing); comm must wait for that all-reduce's own work before writing back."""
    for seen in run_ranks(_late_coalesced_block, backend=None, simulate=NPU, timeout=120):
        for (count, async_ops), tensors in seen.items():
            expected = [_values(i, "cpu", 4 + i) + _values(1 + i, "cpu", 4 + i) for i in range(count)]
            assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True)), (count, async_ops, tensors)


def _mixed(rank, npu, group, into, source):
    """Calls whose tensors lie on two devices: outputs on ``into``, inputs on ``source``."""
    gathered = torch.zeros(12, device=into)
    dist.all_gather_into_tensor(gathered, _values(rank, source), group=group)
    reduced = torch.zeros(3, device=into)
    dist.reduce_scatter_tensor(reduced, _values(rank, source), group=group)
    listed = [torch.zeros(6, device=into) for _ in range(2)] if rank == 0 else None
    dist.gather(_values(rank, source), listed, dst=0, group=group)
    return [t.cpu() for t in (gathered, reduced, *(listed or []))]


def _mixed_devices(rank, world_size):
    npu = torch.device("npu", rank)
    init_group("hccl", rank, world_size, device_id=npu)
    served = _mixed(rank, npu, None, npu, npu)
    before = error_of(_mixed, rank, npu, None, npu, "cpu")
    comm.patch()
    both = {f"{into} <- {source}": _mixed(rank, npu, None, into, source) for into, source in (
        (npu, "cpu"), ("cpu", npu))}
    comm.unpatch()
    return served, before, both


def test_calls_that_mix_devices_stage_once_the_group_is_equipped():
    """Accelerate's gather (an NPU output, a CPU input) and the reverse: torch's values on NPU tensors."""
    for served, before, both in run_ranks(_mixed_devices, backend=None, simulate=NPU):
        assert before is not None and SEED_ERROR in before  # torch alone: the NPU's backend gets the CPU tensor
        assert len(both) == 2
        for got in both.values():
            assert all(torch.equal(a, b) for a, b in zip(got, served, strict=True)), (got, served)


def _npu_model_on_gloo(rank, world_size):
    before = error_of(_ddp_gradient, torch.device("npu", rank), rank, None)
    comm.patch()
    staged = _ddp_gradient(torch.device("npu", rank), rank, None)
    return before, staged, _ddp_gradient("cpu", rank, None), sorted(comm.staged_types())


def test_a_model_on_the_npu_over_a_gloo_group():
    for before, staged, on_cpu, types in run_ranks(_npu_model_on_gloo, simulate=NPU):
        assert before is not None and "No backend type associated with device type npu" in before
        assert torch.equal(staged, on_cpu)
        assert types == ["npu"]


def _async_save_beside_training(rank, world_size):
    comm.patch()
    init_group("hccl", rank, world_size, device_id=torch.device("npu", rank))
    path = os.path.join(os.environ["COMM_TEST_STORE"] + "-checkpoint")
    state = {"weight": _values(rank, "cpu", 64), "step": torch.tensor(7)}
    future = dcp.async_save(state, checkpoint_id=path)
    reduced, busy = 0, True
    while busy or reduced < 20:  # the training thread keeps using the group meanwhile
        tensor = _values(rank, torch.device("npu", rank))
        dist.all_reduce(tensor)
        assert torch.equal(tensor.cpu(), _values(0, "cpu") + _values(1, "cpu"))
        still = torch.tensor([0.0 if future.done() else 1.0], device=torch.device("npu", rank))
        dist.all_reduce(still)  # both ranks go on until both saves are done: the same calls on each
        busy, reduced = bool(still.item()), reduced + 1
    future.result()
    loaded = {"weight": torch.zeros(64), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=path)
    return loaded, state, threading.active_count()


def test_async_save_completes_while_the_training_thread_reduces():
    for loaded, state, _ in run_ranks(_async_save_beside_training, backend=None, simulate=NPU, timeout=300):
        assert torch.equal(loaded["step"], state["step"])
        assert torch.equal(loaded["weight"], _values(0, "cpu", 64))  # DCP saves rank 0's replicated tensor


def test_the_private_names_comm_uses_exist():
    """Fails loudly when a torch release renames what comm.slot needs (see the list in comm/slot.py)."""
    for name in ("_register_backend", "_set_group_name", "_device_types", "_get_backend"):
        assert hasattr(dist.ProcessGroup, name), name
    module_name, name = comm.slot.GROUP_CREATION
    assert module_name == c10d.__name__ and callable(getattr(c10d, name))
    assert isinstance(c10d._world.pg_map, dict)
    assert isinstance(dist.Backend._plugins, dict) and hasattr(c10d, "_DistributedBackendOptions")
    assert {"CUSTOM", "MPI", "UCC", "GLOO"} <= set(dist.ProcessGroup.BackendType.__members__)


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
    """The operators ``call`` runs on simulated-device tensors, by name, counted; a copy is a copy, whichever
    operator makes it (``x.to(device)`` is ``_to_copy``, a copy into a buffer ``copy_``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            if any(t.device.type == "npu" for t in tensors):
                name = str(func.overloadpacket)
                seen["a copy" if name in ("aten._to_copy", "aten.copy_") else name] += 1
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


def _without_the_backend(rank, world_size):
    """COMM_STAGING=0: no staging backend. comm's own calls stage in Python; torch's fail as torch's do."""
    comm.patch()
    seen = {"staged types": sorted(comm.staged_types()), "torch": error_of(dist.all_reduce, torch.ones(2))}
    tensor = _values(rank, "cpu")
    comm.all_reduce(tensor)
    outputs = [torch.zeros(6) for _ in range(world_size)]
    work = comm.all_gather(outputs, _values(rank, "cpu"), async_op=True)
    before_wait = [t.clone() for t in outputs]
    work.wait()
    mixed = torch.zeros(6)  # an NPU tensor received into a CPU one, and the reverse
    if rank == 0:
        comm.send(_values(0, torch.device("npu", 0)), 1)
    else:
        comm.recv(mixed, 0)
    seen.update(summed=tensor, gathered=outputs, before_wait=before_wait, mixed=mixed, stats=comm.stats())
    return seen


def test_without_the_backend_comms_calls_stage_in_python():
    results = run_ranks(_without_the_backend, backend="hccl", simulate=NPU, env={"COMM_STAGING": "0"})
    for rank, seen in enumerate(results):
        assert seen["staged types"] == [] and seen["torch"] == SEED_ERROR
        assert torch.equal(seen["summed"], _values(0, "cpu") + _values(1, "cpu"))
        assert all(torch.equal(got, _values(r, "cpu")) for r, got in enumerate(seen["gathered"]))
        assert all(not t.any() for t in seen["before_wait"])  # written back by wait(), not before
        if rank == 1:
            assert torch.equal(seen["mixed"], _values(0, "cpu"))
        assert seen["stats"]["all_reduce"]["staged_calls"] == 1 and seen["stats"]["all_gather"]["staged_calls"] == 1


# Staging semantics on one rank, in the one-rank worker (tests/multiproc.py's in_one_rank):
# every collective's result is known there, so each is checked against a one-process
# reference. The calls are torch's own, on CPU tensors over the world's hccl group, under
# comm.patched() (which equips the group and undoes only what it patched).

# Each collective as torch takes it, by name: (call(input, output, async_op) -> work, the one-rank result).
# On one rank SUM, AVG and broadcast leave the values as they were; PREMUL_SUM (halving) and the
# collectives with an output tensor (zeros before the call) are the ones that show the write-back.
_ONE_RANK_CALLS = {
    "all_reduce SUM": (lambda t, out, a: dist.all_reduce(t, async_op=a), lambda t: t),
    "all_reduce AVG": (lambda t, out, a: dist.all_reduce(t, dist.ReduceOp.AVG, async_op=a), lambda t: t),
    "all_reduce PREMUL_SUM": (lambda t, out, a: dist.all_reduce(t, dist._make_nccl_premul_sum(0.5), async_op=a),
                              lambda t: t * 0.5),
    "broadcast": (lambda t, out, a: dist.broadcast(t, 0, async_op=a), lambda t: t),
    "all_gather": (lambda t, out, a: dist.all_gather([out], t, async_op=a), lambda t: t),
    "all_gather_into_tensor": (lambda t, out, a: dist.all_gather_into_tensor(out, t, async_op=a), lambda t: t),
    "reduce_scatter_tensor": (lambda t, out, a: dist.reduce_scatter_tensor(out, t, async_op=a), lambda t: t),
    "all_to_all_single": (lambda t, out, a: dist.all_to_all_single(out, t, async_op=a), lambda t: t),
}
# The caller's tensors: contiguous, and every other element of a wider tensor (not contiguous).
_LAYOUTS = {"contiguous": lambda: torch.zeros(3, 4), "strided": lambda: torch.zeros(3, 8)[:, ::2]}


def _one_rank_values():
    return torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)


def _caller_tensors(layout):
    """The input (holding the values) and output tensors a caller passes, in ``layout``."""
    tensor, out = _LAYOUTS[layout](), _LAYOUTS[layout]()
    tensor.copy_(_one_rank_values())
    return tensor, out


def _what_the_caller_sees(tensor):
    """A tensor's memory, dtype, shape and strides: what a staged call must leave as they were."""
    return (tensor.data_ptr(), tensor.device, tensor.dtype, tensor.shape, tensor.stride())


def _staged_on_one_rank(name, layout, async_op):
    """One collective on CPU tensors; the caller's tensors before and after, and its result once waited for."""
    call, _ = _ONE_RANK_CALLS[name]
    tensor, out = _caller_tensors(layout)
    before = (_what_the_caller_sees(tensor), _what_the_caller_sees(out))
    with comm.patched(devices=False):
        work = call(tensor, out, async_op)
        if async_op:
            work.wait()
    after = (_what_the_caller_sees(tensor), _what_the_caller_sees(out))
    result = tensor if name.startswith(("all_reduce", "broadcast")) else out
    return {"unchanged": before == after, "result": result.clone(), "contiguous": result.is_contiguous()}


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("name", sorted(_ONE_RANK_CALLS))
def test_a_staged_collective_on_one_rank_writes_the_one_process_result_into_the_callers_tensor(name, layout, async_op):
    """Written back in place (``wait()`` for an async call): the caller's memory, dtype, shape and strides kept."""
    seen = in_one_rank(_staged_on_one_rank, name, layout, async_op)
    assert seen["unchanged"]
    assert seen["contiguous"] == (layout == "contiguous")
    assert torch.equal(seen["result"], _ONE_RANK_CALLS[name][1](_one_rank_values()))


def _future_of_a_staged_all_reduce():
    """Whether an async staged all_reduce's future gives the caller's own tensor, with the result in it."""
    tensor = _one_rank_values()
    with comm.patched(devices=False):
        [value] = dist.all_reduce(tensor, async_op=True).get_future().wait()
    return {"the caller's tensor": value is tensor, "values": value.clone()}


def test_a_staged_calls_future_on_one_rank_gives_the_callers_tensor():
    seen = in_one_rank(_future_of_a_staged_all_reduce)
    assert seen["the caller's tensor"]
    assert torch.equal(seen["values"], _one_rank_values())


def _cost_of_one_staged_all_reduce():
    """comm.stats() and the device's counters for one staged all_reduce of a CPU tensor, counted from zero."""
    from comm.testing import device_counters, reset_counters

    with comm.patched(devices=False):
        dist.all_reduce(torch.zeros(1))  # the first call makes the communicator: not counted
        comm.reset_stats()
        reset_counters()
        dist.all_reduce(_one_rank_values())
    counted = device_counters(0)
    return {"stats": comm.stats(), "device": {key: counted[key] for key in ("host_syncs", "drains")}}


def test_one_staged_all_reduce_on_one_rank_counts_one_call_two_transfers_and_one_host_sync():
    """Staged once (a copy in, a copy back) and written back after one host wait, never draining the device."""
    seen = in_one_rank(_cost_of_one_staged_all_reduce)
    assert list(seen["stats"]) == ["all_reduce"]
    stats = seen["stats"]["all_reduce"]
    assert (stats["staged_calls"], stats["transfers"]) == (1, 2)
    assert stats["bytes_staged"] == 2 * _one_rank_values().nbytes
    assert seen["device"] == {"host_syncs": 1, "drains": 0}


def test_equip_leaves_a_group_without_backends_alone():
    """A ProcessGroup made bare (no backend, so no name: asking it raises) serves no device of this process's."""
    bare = dist.ProcessGroup(dist.HashStore(), 0, 1)
    assert comm.equip(bare) == frozenset()


def _coalescing_methods_over_a_groups_life(rank, world_size):
    """Who holds ProcessGroup's coalescing methods before, while and after an equipped group lives."""
    import gc

    from comm import _ledger

    torchs = (vars(dist.ProcessGroup)["_start_coalescing"], vars(dist.ProcessGroup)["_end_coalescing"])

    def held():
        return (vars(dist.ProcessGroup)["_start_coalescing"], vars(dist.ProcessGroup)["_end_coalescing"])

    seen = {"before": held() == torchs}
    init_group("hccl", rank, world_size, device_id=torch.device("npu", rank))
    comm.equip()
    seen["while"] = [a is not b for a, b in zip(held(), torchs)]
    seen["recorded"] = sorted(entry.name for entry in _ledger.entries() if entry.by == "comm.slot")
    dist.destroy_process_group()
    gc.collect()
    seen["after"] = [a is b for a, b in zip(held(), torchs)]
    return seen


def test_torchs_coalescing_methods_are_comms_while_an_equipped_group_lives_and_torchs_again_after():
    """Replaced through comm's ledger at the first equipped group, put back once the last is collected."""
    [seen] = run_ranks(_coalescing_methods_over_a_groups_life, 1, backend=None, simulate=NPU)
    assert seen == {"before": True, "while": [True, True], "recorded": ["_end_coalescing", "_start_coalescing"],
                    "after": [True, True]}
