"""comm.collectives: torch's results on every device, staged by comm's backend where the group needs it."""

import functools
import gc
import inspect
import logging
import re
import sys
import time
import traceback
import weakref
from typing import Any, Callable, List

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import comm
import comm.groups
import comm.testing
from comm import collectives
from comm._releases import TORCH_VERSION

from faults import FAILURE_MODES, failure_problems
from multiproc import NPU, SEED_ERROR, error_of, gloo_lacks_all_to_all, run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]


def _data(rank, dtype, contiguous=True, numel=12, device="cpu"):
    """Distinct, exactly representable values per rank; a strided view when not contiguous."""
    values = (torch.arange(numel) * (rank + 1)) % 7
    tensor = (values % 2 == 0) if dtype == torch.bool else values.to(dtype)
    if not contiguous:
        holder = torch.zeros(numel * 2, dtype=tensor.dtype)
        holder[::2] = tensor
        tensor = holder[::2]
    return tensor.to(device)


def _wrapper_calls(rank, group):
    """(name, call(module, tensors, async_op), make(dtype, contiguous) -> tensors) per wrapper.

    ``module`` is ``torch.distributed`` or ``comm``: the same call is made on both.
    """
    size = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    root = ranks[-1]
    me = ranks.index(rank)
    is_root = rank == root
    sends = [me + 1 + i for i in range(size)]  # uneven all_to_all_single: what this rank sends to each
    receives = [i + 1 + me for i in range(size)]

    def single(dtype, contiguous):
        return [_data(rank, dtype, contiguous)]

    def gather(dtype, contiguous):
        return [_data(rank, dtype, contiguous)] + [torch.zeros(12, dtype=dtype) for _ in range(size)]

    def into(dtype, contiguous):
        return [torch.zeros(12 * size, dtype=dtype), _data(rank, dtype, contiguous)]

    def scatter(dtype, contiguous):
        return [torch.zeros(12 // size * 1, dtype=dtype), _data(rank, dtype, contiguous, numel=12 // size * size)]

    def pieces(dtype, contiguous):  # one output, then one input per rank
        return [torch.zeros(4, dtype=dtype)] + [_data(rank + i, dtype, contiguous, numel=4) for i in range(size)]

    def exchange(dtype, contiguous):  # one output and one input per rank
        return [torch.zeros(3, dtype=dtype) for _ in range(size)] + [
            _data(rank * size + i, dtype, contiguous, numel=3) for i in range(size)]

    def even(dtype, contiguous):
        return [torch.zeros(12, dtype=dtype), _data(rank, dtype, contiguous)]

    def uneven(dtype, contiguous):
        return [torch.zeros(sum(receives), dtype=dtype), _data(rank, dtype, contiguous, numel=sum(sends))]

    return [
        ("all_reduce sum", lambda m, t, a: m.all_reduce(t[0], group=group, async_op=a), single),
        ("all_reduce max", lambda m, t, a: m.all_reduce(t[0], ReduceOp.MAX, group, a), single),
        ("broadcast", lambda m, t, a: m.broadcast(t[0], src=root, group=group, async_op=a), single),
        ("reduce", lambda m, t, a: m.reduce(t[0], dst=root, group=group, async_op=a), single),
        ("all_gather", lambda m, t, a: m.all_gather(t[1:], t[0], group, a), gather),
        ("all_gather_into_tensor", lambda m, t, a: m.all_gather_into_tensor(t[0], t[1], group, a), into),
        ("reduce_scatter_tensor", lambda m, t, a: m.reduce_scatter_tensor(t[0], t[1], group=group, async_op=a),
         scatter),
        ("all_gather_single", lambda m, t, a: _or_flat(m, "all_gather_single")(t[0], t[1], group, a), into),
        ("reduce_scatter_single",
         lambda m, t, a: _or_flat(m, "reduce_scatter_single")(t[0], t[1], group=group, async_op=a), scatter),
        ("gather", lambda m, t, a: m.gather(t[0], t[1:] if is_root else None, dst=root, group=group, async_op=a),
         gather),
        ("scatter", lambda m, t, a: m.scatter(t[0], t[1:] if is_root else None, src=root, group=group, async_op=a),
         pieces),
        ("reduce_scatter", lambda m, t, a: m.reduce_scatter(t[0], t[1:], group=group, async_op=a), pieces),
        # Left out where gloo (which the simulated NPU runs on too) lacks it: torch 2.9's.
        *([] if gloo_lacks_all_to_all() else [
            ("all_to_all", lambda m, t, a: m.all_to_all(t[:size], t[size:], group, a), exchange)]),
        ("all_to_all_single", lambda m, t, a: m.all_to_all_single(t[0], t[1], group=group, async_op=a), even),
        ("all_to_all_single uneven", lambda m, t, a: m.all_to_all_single(t[0], t[1], receives, sends, group, a),
         uneven),
        ("all_to_all_single empty splits", lambda m, t, a: m.all_to_all_single(t[0], t[1], [], [], group, a), even),
    ]


def _or_flat(module, name):
    """``module``'s function ``name``, or where torch lacks it (before 2.12) the flat form it replaces."""
    flat = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}[name]
    return getattr(module, name, None) or getattr(module, flat)


def _outcome(module, call, tensors, async_op):
    """Run one call; return ("ok", tensors) or ("error", exception type name)."""
    try:
        work = call(module, tensors, async_op)
        if async_op and work is not None:
            work.wait()
    except Exception as error:  # noqa: BLE001 - the outcome is compared, not handled
        return ("error", type(error).__name__)
    return ("ok", tensors)


def _differences(rank, group, dtypes, label):
    """Every call of comm's against torch's own on the same data; returns what differed."""
    differences = []
    destination = dist.get_process_group_ranks(group or dist.group.WORLD)[-1]  # torch 2.1 refuses None
    for name, call, make in _wrapper_calls(rank, group):
        for dtype in dtypes:
            for contiguous in (True, False):
                for async_op in (False, True):
                    expected = _outcome(dist, call, make(dtype, contiguous), async_op)
                    got = _outcome(comm, call, make(dtype, contiguous), async_op)
                    case = f"{label} {name} {dtype} contiguous={contiguous} async={async_op}"
                    if name in ("reduce", "gather") and dist.get_rank() != destination:
                        continue  # torch leaves non-destination tensors unspecified
                    if expected[0] != got[0]:
                        differences.append(f"{case}: torch {expected} vs comm {got}")
                    elif expected[0] == "ok" and not all(
                        torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(expected[1], got[1])
                    ):
                        differences.append(f"{case}: values differ")
    return differences


def _matches_torch_on_gloo(rank, world_size):
    subgroup_ranks = [0, world_size - 1] if world_size > 2 else [1, 0]
    subgroup = dist.new_group(subgroup_ranks)
    differences = _differences(rank, None, DTYPES, "world")
    if rank in subgroup_ranks:
        differences += _differences(rank, subgroup, DTYPES, "subgroup")
    else:
        untouched = torch.ones(3)
        returned = comm.all_reduce(untouched, group=subgroup)
        if returned is not None or not torch.equal(untouched, torch.ones(3)):
            differences.append("non-member rank communicated")
    for group in (None, subgroup) if rank in subgroup_ranks else (None,):
        comm.barrier(group)
        comm.barrier(group, async_op=True).wait()
    if comm.stats():
        differences.append(f"served calls were staged: {comm.stats()}")
    return differences


@pytest.mark.parametrize("world_size", [2, 3])
def test_bit_identical_to_torch_on_gloo(world_size):
    assert run_ranks(_matches_torch_on_gloo, world_size) == [[]] * world_size


def _cpu_tensors_on_simulated_hccl(rank, world_size):
    """CPU tensors (FSDP offload) through every wrapper, and through torch's own function under
    comm.patch(), match the same data on the NPU; torch alone fails with the seed's error."""
    group = dist.group.WORLD
    differences = []
    for name, call, make in _wrapper_calls(rank, group):  # before comm meets the group
        unpatched = error_of(call, dist, make(torch.float32, True), False)
        if unpatched != SEED_ERROR:
            differences.append(f"{name}: torch alone on CPU tensors says {unpatched!r}")
    for name, call, make in _wrapper_calls(rank, group):
        for dtype in (torch.float32, torch.int64):
            for async_op in (False, True):
                on_npu = [t.to(f"npu:{rank}") for t in make(dtype, True)]
                expected = _outcome(dist, call, on_npu, async_op)
                on_cpu = make(dtype, True)
                through_comm = _outcome(comm, call, on_cpu, async_op)
                with comm.patched():
                    through_patch = _outcome(dist, call, make(dtype, True), async_op)
                for label, got in (("comm", through_comm), ("patched torch", through_patch)):
                    if got[0] != "ok" or expected[0] != "ok":
                        differences.append(f"{name} {dtype}: {label} {got[0]}, torch on npu {expected[0]}")
                    elif not all(torch.equal(a, b.cpu()) for a, b in zip(got[1], expected[1])):
                        if not (name in ("reduce", "gather") and rank != world_size - 1):
                            differences.append(f"{name} {dtype} async={async_op}: {label} values differ")
                if any(t.device.type != "cpu" for t in on_cpu):
                    differences.append(f"{name}: a caller tensor changed device")
    mixed = [torch.zeros(4) for _ in range(world_size)]  # NPU input, CPU outputs
    comm.all_gather(mixed, torch.full((4,), float(rank), device=f"npu:{rank}"))
    if not all(torch.equal(t, torch.full((4,), float(r))) for r, t in enumerate(mixed)):
        differences.append("all_gather npu -> cpu outputs differ")
    future = comm.all_reduce(torch.ones(3), async_op=True).get_future()
    if not torch.equal(future.wait()[0], torch.full((3,), float(world_size))):
        differences.append("get_future result differs")
    sent = torch.ones(2)  # the root of a staged broadcast writes nothing back, yet its future holds the tensor
    if comm.broadcast(sent, src=0, async_op=True).get_future().wait()[0] is not sent:
        differences.append("a staged broadcast's future does not hold the caller's tensor")
    with torch.inference_mode():
        made_in_inference = torch.ones(3)
        pending = comm.all_reduce(made_in_inference, async_op=True)
    pending.wait()  # written back outside inference_mode
    if not torch.equal(made_in_inference, torch.full((3,), float(world_size))):
        differences.append("an inference tensor was not written back")
    return differences + _object_collectives(rank, world_size)


def _object_collectives(rank, world_size):
    """torch's object collectives on the hccl group, unpatched: they serialise onto the device themselves."""
    problems = []
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"rank": rank})
    if everyone != [{"rank": r} for r in range(world_size)]:
        problems.append(f"all_gather_object: {everyone}")
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(("from", rank), gathered, dst=0)
    if rank == 0 and gathered != [("from", r) for r in range(world_size)]:
        problems.append(f"gather_object: {gathered}")
    sent = [f"sent by {rank}", rank * 10]
    dist.broadcast_object_list(sent, src=1)
    if sent != ["sent by 1", 10]:
        problems.append(f"broadcast_object_list: {sent}")
    received = [None]
    dist.scatter_object_list(received, [r * r for r in range(world_size)] if rank == 0 else None, src=0)
    if received != [rank * rank]:
        problems.append(f"scatter_object_list: {received}")
    return problems


def test_cpu_tensors_on_simulated_hccl():
    assert run_ranks(_cpu_tensors_on_simulated_hccl, 2, backend="hccl", simulate=NPU) == [[], []]


def _uneven_and_avg(rank, world_size, force_avg_emulation):
    if force_avg_emulation:
        # Configure gloo as lacking AVG: the emulation must match gloo's native AVG.
        comm.groups.NATIVE_AVG_SINCE["gloo"] = None
    device = "cpu"
    seen = {}
    outputs = [torch.full((r + 1, 2), -1.0) for r in range(world_size)]
    comm.all_gather(outputs, torch.full((rank + 1, 2), float(rank)).to(device))
    seen["uneven"] = outputs
    work = comm.all_gather([torch.zeros(r + 2) for r in range(world_size)], torch.ones(rank + 2), async_op=True)
    seen["uneven_async"] = work.result()
    values = _data(rank, torch.float64) + 0.25 * rank
    for name, run in [
        ("all_reduce", lambda t: comm.all_reduce(t, ReduceOp.AVG)),
        ("reduce", lambda t: comm.reduce(t, dst=0, op=ReduceOp.AVG)),
        ("coalesced", lambda t: comm.all_reduce_coalesced([t], ReduceOp.AVG)),
    ]:
        tensor = values.clone()
        run(tensor)
        seen[name] = tensor
    scattered = torch.zeros(6, dtype=torch.float64)
    try:
        comm.reduce_scatter_tensor(scattered, values.clone(), ReduceOp.AVG)
        seen["reduce_scatter"] = scattered
    except RuntimeError as error:  # gloo in torch 2.1 cannot reduce-scatter: torch's error passes through
        seen["reduce_scatter"] = (str(error), error_of(
            dist.reduce_scatter_tensor, torch.zeros(6, dtype=values.dtype), values.clone()))
    integers = torch.arange(4)
    # gloo divides in floating point; HCCL averages integers, but this simulated part has no AVG at all.
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long|"
                                           "Cannot use ReduceOp.AVG with HCCL"):
        comm.all_reduce(integers, op=ReduceOp.AVG)
    floats = torch.ones(3)
    # The integer tensor comes second: comm's AVG refuses it, or torch refuses the mix, before anything is sent.
    with pytest.raises((RuntimeError, ValueError), match="result type Float can't be cast|different dtypes"):
        comm.all_reduce_coalesced([floats, integers], op=ReduceOp.AVG)
    seen["floats_untouched"] = torch.equal(floats, torch.ones(3))
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # a group of one (NCCL's AVG is wrong there)
    by_itself = values.clone()
    comm.all_reduce(by_itself, ReduceOp.AVG, alone)
    seen["avg_alone"] = torch.equal(by_itself, values)
    # Emulated AVG refuses integers before communicating; gloo's native AVG raises
    # the same error only after its SUM landed in the tensor (torch's behaviour).
    seen["integers_untouched"] = torch.equal(integers, torch.arange(4))
    seen["emulated"] = force_avg_emulation or dist.get_backend() == "hccl"
    if seen["emulated"]:
        on_device = values.to(comm.current_device(), torch.float32)  # a dtype HCCL reduces
        seen["torch_avg"] = error_of(functools.partial(dist.all_reduce, on_device, op=ReduceOp.AVG))
    return seen


def _check_uneven_and_avg(results, world_size):
    reference = sum(_data(r, torch.float64) + 0.25 * r for r in range(world_size)) / world_size
    for rank, seen in enumerate(results):
        for r, out in enumerate(seen["uneven"]):
            assert torch.equal(out, torch.full((r + 1, 2), float(r)))
        assert [t.tolist() for t in seen["uneven_async"]] == [[1.0] * (r + 2) for r in range(world_size)]
        assert torch.equal(seen["all_reduce"], reference)
        assert torch.equal(seen["coalesced"], reference)
        if rank == 0:
            assert torch.equal(seen["reduce"], reference)
        if isinstance(seen["reduce_scatter"], tuple):
            comm_error, torch_error = seen["reduce_scatter"]
            assert comm_error == torch_error
        else:
            assert torch.equal(seen["reduce_scatter"], reference[rank * 6 : rank * 6 + 6])
        assert seen["integers_untouched"] or not seen["emulated"]
        assert seen["floats_untouched"] or not seen["emulated"]
        assert seen["avg_alone"]


@pytest.mark.parametrize("force_avg_emulation", [False, True], ids=["native-avg", "emulated-avg"])
def test_uneven_all_gather_and_avg_on_gloo(force_avg_emulation):
    results = run_ranks(_uneven_and_avg, 2, args=(force_avg_emulation,))
    _check_uneven_and_avg(results, 2)
    if force_avg_emulation:  # what gloo itself does, as comm's table says: AVG since torch 2.8
        gloo_avg = TORCH_VERSION >= comm.groups.NATIVE_AVG_SINCE["gloo"]["all_reduce"]
        assert results[0]["torch_avg"] == (None if gloo_avg else "Cannot use ReduceOp.AVG with Gloo")


def test_uneven_all_gather_and_avg_on_simulated_hccl_without_avg():
    simulate = dict(NPU, unsupported_ops=[ReduceOp.AVG])
    results = run_ranks(_uneven_and_avg, 2, backend="hccl", simulate=simulate, args=(False,))
    _check_uneven_and_avg(results, 2)
    assert results[0]["torch_avg"] == "Cannot use ReduceOp.AVG with HCCL"


def _call_and_wait(call: Callable[..., Any], tensors: List[torch.Tensor], async_op: bool) -> None:
    """comm's ``call`` on ``tensors``, waited for when it returns a work."""
    work = call(comm, tensors, async_op)
    if work is not None:
        work.wait()


def _failures_leave_tensors_unchanged(rank, world_size):
    group = dist.new_group([0, 1])
    problems = []
    for name, call, make in _wrapper_calls(rank, group):
        for mode in FAILURE_MODES:
            for async_op in (False, True):
                tensors = make(torch.float32, True)
                staged = functools.partial(_call_and_wait, call, tensors, async_op)
                problems += failure_problems(f"{name} async={async_op}", staged, tensors, group, mode, calls=2)
    recovered = torch.full((2,), float(rank))
    comm.all_reduce(recovered, group=group)
    if not torch.equal(recovered, torch.full((2,), 1.0)):
        problems.append("the next call after failures was wrong")
    return problems


def test_staging_failure_leaves_caller_tensors_bit_identical():
    assert run_ranks(_failures_leave_tensors_unchanged, 2, backend="hccl", simulate=NPU) == [[], []]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _stats_and_log(rank, world_size):
    records = _Records()
    logging.getLogger("comm").addHandler(records)
    logging.getLogger("comm").setLevel(logging.INFO)
    comm.reset_stats()
    for _ in range(3):
        comm.all_reduce(torch.ones(4))  # staged: 16 bytes in, 16 bytes back
    comm.all_reduce(torch.ones(4, device=f"npu:{rank}"))  # served
    dist.broadcast(torch.ones(2, dtype=torch.float64), src=0)  # torch's own call, staged all the same
    comm.all_reduce_coalesced([torch.ones(2, device=f"npu:{rank}")] * 2)  # served: nothing staged
    stats = comm.stats()
    comm.testing.reset_counters()
    many = [torch.full((3,), float(rank)) for _ in range(8)]
    comm.all_reduce_coalesced(many)  # eight small tensors: one transfer each way, one collective
    counted = comm.testing.counters()
    correct = all(torch.equal(t, torch.full((3,), 1.0)) for t in many)
    return stats, records.messages, counted, correct


def test_stats_and_the_staging_log():
    for rank, (stats, messages, counted, correct) in enumerate(
        run_ranks(_stats_and_log, 2, backend="hccl", simulate=NPU)
    ):
        assert counted == {"transfers": 2, "collectives": 1} and correct
        assert set(stats) == {"all_reduce", "broadcast"}, stats
        assert stats["all_reduce"]["staged_calls"] == 3 and stats["all_reduce"]["transfers"] == 6
        assert stats["all_reduce"]["bytes_staged"] == 3 * 32
        assert stats["all_reduce"]["staging_seconds"] > 0
        assert stats["broadcast"]["staged_calls"] == 1
        assert stats["broadcast"]["bytes_staged"] == 16  # the source copies nothing back, the others nothing in
        assert messages == [f"comm stages cpu on group '0' onto npu:{rank}"], messages  # comm.bind's device


def test_uninitialised_default_group():
    with pytest.raises(ValueError, match="Default process group has not been initialized"):  # torch's own error
        comm.all_reduce(torch.ones(1))


@pytest.mark.cuda
def test_cpu_tensors_on_a_real_nccl_group(nccl_group):
    """The second seed on real hardware: torch refuses CPU tensors on nccl, comm stages them."""
    with pytest.raises(RuntimeError, match=SEED_ERROR):
        dist.all_reduce(torch.ones(4))
    values = torch.arange(8.0)
    summed = values.clone()
    comm.all_reduce(summed)
    assert torch.equal(summed, values) and summed.device.type == "cpu"
    averaged = values.clone()
    comm.all_reduce(averaged, op=ReduceOp.AVG)  # nccl's AVG is emulated at world size 1
    assert torch.equal(averaged, values)
    sent = values.clone()
    comm.broadcast(sent, src=0)
    assert torch.equal(sent, values)
    gathered = [torch.zeros(8)]
    work = comm.all_gather(gathered, values, async_op=True)
    work.wait()
    assert torch.equal(gathered[0], values)
    uneven = [torch.zeros(3)]
    comm.all_gather(uneven, values[:3])
    assert torch.equal(uneven[0], values[:3])
    scattered = torch.zeros(8)
    comm.reduce_scatter_tensor(scattered, values.clone())
    assert torch.equal(scattered, values)
    assert comm.stats()["all_reduce"]["staged_calls"] == 2


@pytest.mark.cuda
def test_staging_bandwidth_for_one_gib(nccl_group):
    """Prints staging throughput for a 1 GiB CPU tensor against a plain pinned round trip."""
    elements = 1 << 28  # 1 GiB of float32
    host = torch.ones(elements)
    comm.all_reduce(host[:1024])  # warm up the path and NCCL
    torch.cuda.synchronize()
    start = time.perf_counter()
    comm.all_reduce(host)
    torch.cuda.synchronize()
    staged = time.perf_counter() - start
    pinned = torch.ones(elements).pin_memory()
    start = time.perf_counter()
    on_device = pinned.to("cuda", non_blocking=True)
    pinned.copy_(on_device, non_blocking=True)
    torch.cuda.synchronize()
    plain = time.perf_counter() - start
    gib = elements * 4 / 2**30
    print(f"\nstaging 1 GiB through comm.all_reduce: {staged:.3f} s ({2 * gib / staged:.1f} GiB/s moved); "
          f"pinned H2D+D2H copy: {plain:.3f} s ({2 * gib / plain:.1f} GiB/s)")
    assert torch.equal(host[:4], torch.ones(4))


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_is_learnt_at_its_first_call_and_forgotten_once_collected(one_rank_gloo):
    """The first call of a name on a group checks everything and learns the group; comm keeps no group alive: a
    destroyed group is collected and forgotten, and the next default group is learnt in its turn."""
    tensor = torch.ones(2)
    comm.all_reduce(tensor)
    other = dist.new_group([0])
    comm.all_reduce(tensor, group=other)
    assert {id(one_rank_gloo), id(other)} <= set(collectives._FAST["all_reduce"])
    dist.destroy_process_group(other)
    collected = weakref.ref(other)
    del other
    gc.collect()
    assert collected() is None
    assert list(collectives._FAST["all_reduce"]) == [id(one_rank_gloo)]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert comm.all_reduce.__globals__["fast_default"]() is not dist.group.WORLD
    comm.all_reduce(tensor)  # the new default group, learnt in its turn
    assert id(dist.group.WORLD) in collectives._FAST["all_reduce"]
    assert torch.equal(tensor, torch.ones(2))


def test_a_learnt_call_fails_and_logs_as_torchs_own(one_rank_gloo, caplog):
    """torch's exception logger records a failed collective; comm's function, which takes its place, records the
    same, and raises the same exception."""
    other = dist.new_group([0])
    comm.all_reduce(torch.ones(1))
    comm.all_reduce(torch.ones(1), group=other)  # both learnt: the calls below take the fast path
    logger = torch.distributed.c10d_logger._c10d_logger
    seen = {}
    for module in (dist, comm):
        with caplog.at_level(logging.DEBUG, logger=logger.name):
            caplog.clear()
            errors = [error_of(module.all_reduce, [1.0], catch=(Exception,), typed=True),
                      error_of(functools.partial(module.all_reduce, torch.ones(1), group=other, op="sum"),
                               catch=(Exception,), typed=True)]
            messages = [record.getMessage() for record in caplog.records]
            seen[module.__name__] = [re.sub(r"0x[0-9a-f]+", "0x", text or "") for text in errors + messages]
            loggers = {record.filename for record in caplog.records}
    assert loggers == {"collectives.py"}  # comm's fast path logged them, in the wrapper's place
    assert seen["comm"] == seen["torch.distributed"]
    assert len(seen["comm"]) == 4 and all(seen["comm"])


def test_a_failure_inside_comms_call_shows_its_source_line(one_rank_gloo):
    """comm's calls are written at import: their source is where tracebacks and inspect look for it."""
    comm.all_reduce(torch.ones(1))  # learnt: the next call fails inside the fast path
    try:
        comm.all_reduce(torch.ones(1), op="sum")
    except Exception:  # noqa: BLE001 - whatever torch raises for the op
        frames = traceback.extract_tb(sys.exc_info()[2])
    inside = [frame for frame in frames if frame.filename == "<comm.all_reduce>"]
    assert inside and inside[-1].line == "return target(tensor, op, group, async_op)", frames
    assert inspect.getsource(comm.all_reduce).startswith("def all_reduce(tensor, op=default_op, group=default_group")


def test_retarget_points_comms_call_at_another_function(one_rank_gloo):
    """comm.profile() times comm's calls by retargeting them: the first call of a name on a group (the general
    path) and every later one (the fast path) run what retarget() put there, until torch's is put back."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("group", args[2] if len(args) > 2 else None))
        return dist.all_reduce(*args, **kwargs)

    other = dist.new_group([0])
    original = collectives.retarget("all_reduce", spy)
    try:
        assert collectives.TORCH["all_reduce"] is spy
        for _ in range(2):
            comm.all_reduce(torch.ones(1), group=other)
    finally:
        assert collectives.retarget("all_reduce", original) is spy
    comm.all_reduce(torch.ones(1), group=other)
    assert calls == [other, other]
    assert collectives.TORCH["all_reduce"] is original is dist.all_reduce
    with pytest.raises(TypeError):
        collectives.TORCH["all_reduce"] = spy  # read-only: retarget() is the one way to change it
    with pytest.raises(KeyError, match="comm has no call named 'nope'"):
        collectives.retarget("nope", spy)


def test_signatures_and_argument_errors_are_torchs():
    for name in collectives.COLLECTIVES:
        explicit = getattr(comm, name)
        assert inspect.signature(explicit) == inspect.signature(collectives.TORCH[name]), name
        assert explicit.__name__ == explicit.__qualname__ == name and explicit.__module__ == "comm.collectives"
    for call in (lambda m: m.all_reduce(), lambda m: m.all_reduce(torch.ones(1), nope=1),
                 lambda m: m.broadcast(torch.ones(1), 0, None, False, None, 1)):
        errors = [error_of(call, module, catch=(TypeError,)) for module in (dist, comm)]
        assert errors[0] and errors[1] == errors[0]
