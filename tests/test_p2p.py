"""comm.p2p: point-to-point calls give torch's results, and each side stages its own tensor."""

import functools

import pytest
import torch
import torch.distributed as dist

import comm

from faults import FAILURE_MODES, failure_problems
from multiproc import NPU, SEED_ERROR, error_of, run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _data(seed, dtype, contiguous=True, numel=6, device="cpu"):
    values = (torch.arange(numel) * (seed + 2)) % 11
    tensor = values.to(dtype)
    if not contiguous:
        holder = torch.zeros(numel * 2, dtype=dtype)
        holder[::2] = tensor
        tensor = holder[::2]
    return tensor.to(device)


def _exchanges(module, group, dtype, contiguous, device="cpu", any_source=True):
    """One ring exchange per kind of point-to-point call, made with ``module`` (torch or comm).

    Returns what each receive got and what each call returned that is not a work
    handle (recv's sender rank), so two runs can be compared value for value.
    """
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    after, before = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    seen = {}

    def fresh(tag):
        return _data(100 * tag + dist.get_rank(), dtype, contiguous, device=device)

    def empty():
        return torch.zeros(6, dtype=dtype, device=device)

    # send/recv: even group ranks send first, odd ones receive first, so nobody waits on a peer's send
    received = empty()
    steps = [lambda: module.send(fresh(1), after, group), lambda: module.recv(received, before, group)]
    returns = [step() for step in (steps if me % 2 == 0 else steps[::-1])]
    seen["send/recv"] = (received, [r for r in returns if r is not None])
    # any source: group rank 0 receives from each other rank in turn, which returns the sender
    if not any_source:
        pass  # the group's backend cannot (hccl)
    elif me == 0:
        senders = []
        for _ in ranks[1:]:
            into = empty()
            senders.append((module.recv(into, group=group), into))
        seen["any source"] = sorted(senders, key=lambda pair: pair[0])
    else:
        module.send(fresh(2), ranks[0], group, tag=0)
    # isend/irecv with a tag, both started before either is waited on
    received = empty()
    works = [module.isend(fresh(3), after, group, tag=7), module.irecv(received, before, group, tag=7)]
    for work in works:
        work.wait()
    seen["isend/irecv"] = received
    # a batch built with this module's P2POp and functions
    received = empty()
    op_class = comm.P2POp if module is comm else dist.P2POp
    ops = [op_class(module.isend, fresh(4), after, group), op_class(module.irecv, received, before, group)]
    for work in module.batch_isend_irecv(ops):
        work.wait()
    seen["batch"] = received
    return seen


def _flatten(value):
    if isinstance(value, torch.Tensor):
        return [value.cpu()]
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _flatten(part)]
    return [value]


def _same(a, b):
    a, b = _flatten(a), _flatten(b)
    return len(a) == len(b) and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


def _matches_torch_on_gloo(rank, world_size):
    groups = {"world": dist.group.WORLD}
    subgroup_ranks = [0, world_size - 1] if world_size > 2 else [1, 0]
    subgroup = dist.new_group(subgroup_ranks)
    if rank in subgroup_ranks:
        groups["subgroup"] = subgroup
    differences = []
    for label, group in groups.items():
        for dtype in DTYPES:
            expected = _exchanges(dist, group, dtype, True)
            got = _exchanges(comm, group, dtype, True)
            for kind in expected:
                if not _same(expected[kind], got[kind]):
                    differences.append(f"{label} {kind} {dtype}: {got[kind]} vs torch {expected[kind]}")
            # Strided tensors: torch refuses them before communicating; comm must say the same.
            peer = [r for r in dist.get_process_group_ranks(group) if r != rank][0]
            for kind in ("isend", "irecv"):
                outcomes = [error_of(getattr(m, kind), _data(0, dtype, False), peer, group,
                                     catch=(RuntimeError, ValueError), typed=True) for m in (dist, comm)]
                if outcomes[0] != outcomes[1] or outcomes[0] is None:
                    differences.append(f"{label} strided {kind} {dtype}: torch {outcomes[0]}, comm {outcomes[1]}")
    return differences


@pytest.mark.parametrize("world_size", [2, 3])
def test_bit_identical_to_torch_on_gloo(world_size):
    assert run_ranks(_matches_torch_on_gloo, world_size) == [[]] * world_size


def _cpu_tensors_on_simulated_hccl(rank, world_size):
    """CPU tensors through comm, and through torch under comm.patch(), match NPU tensors through torch."""
    group = dist.group.WORLD
    seen = {"torch alone": {}}
    for kind, call in [
        ("send", lambda: dist.send(torch.ones(2), 1 - rank)),
        ("recv", lambda: dist.recv(torch.ones(2), 1 - rank)),
        ("isend", lambda: dist.isend(torch.ones(2), 1 - rank)),
        ("batch", lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.ones(2), 1 - rank)])),
    ]:
        seen["torch alone"][kind] = error_of(call)
    npu = f"npu:{rank}"
    differences = []
    for dtype in (torch.float32, torch.int64):  # HCCL cannot receive from any source (tests/test_simulated_hccl.py)
        expected = _exchanges(dist, group, dtype, True, device=npu, any_source=False)
        got = _exchanges(comm, group, dtype, True, device="cpu", any_source=False)
        with comm.patched():
            patched = _exchanges(dist, group, dtype, True, device="cpu", any_source=False)
        for kind in expected:
            for label, values in (("comm", got), ("patched torch", patched)):
                if not _same(expected[kind], values[kind]):
                    differences.append(f"{label} {kind} {dtype}: {values[kind]} vs torch on npu {expected[kind]}")
                if any(t.device.type != "cpu" for t in _flatten(values[kind]) if isinstance(t, torch.Tensor)):
                    differences.append(f"{label} {kind}: a received tensor is not on the CPU")
    seen["differences"] = differences
    # Each side stages its own tensor: CPU to NPU, and NPU to CPU.
    mixed = torch.zeros(3, device=npu) if rank == 0 else torch.zeros(3)
    if rank == 0:
        comm.send(torch.arange(3.0), 1)
        comm.recv(mixed, 1)
    else:
        comm.recv(mixed, 0)
        comm.send(torch.arange(3.0, device=npu) * 2, 0)
    seen["mixed"] = (mixed.cpu(), mixed.device.type)
    comm.reset_stats()
    received = torch.zeros(2)
    if rank == 0:
        comm.isend(torch.ones(2), 1).wait()
    else:
        comm.irecv(received, 0).wait()
    ops = [comm.P2POp(comm.isend, torch.ones(2), 1 - rank), comm.P2POp(comm.irecv, torch.zeros(2), 1 - rank)]
    for work in comm.batch_isend_irecv(ops):
        work.wait()
    seen["stats"] = comm.stats()
    return seen


def test_cpu_tensors_on_simulated_hccl():
    results = run_ranks(_cpu_tensors_on_simulated_hccl, 2, backend="hccl", simulate=NPU)
    for rank, seen in enumerate(results):
        assert seen["differences"] == []
        assert seen["torch alone"] == dict.fromkeys(("send", "recv", "isend", "batch"), SEED_ERROR)
        values, device = seen["mixed"]
        assert torch.equal(values, torch.arange(3.0) * (2 if rank == 0 else 1))
        assert device == ("npu" if rank == 0 else "cpu")
        stats = seen["stats"]
        # What c10d hands comm's backend: a send and a receive each, whichever function issued them.
        sends, receives = (2, 1) if rank == 0 else (1, 2)
        assert (stats["send"]["staged_calls"], stats["recv"]["staged_calls"]) == (sends, receives), stats


def _failures_leave_tensors_unchanged(rank, world_size):
    group = dist.new_group([0, 1])
    peer = 1 - rank
    problems = []
    calls = {
        "recv": lambda t: comm.recv(t, peer, group) if rank else comm.send(torch.ones(4), peer, group),
        "irecv": lambda t: (comm.irecv(t, peer, group) if rank else comm.isend(torch.ones(4), peer, group)).wait(),
        "batch": lambda t: [w.wait() for w in comm.batch_isend_irecv(
            [comm.P2POp(comm.irecv if rank else comm.isend, t if rank else torch.ones(4), peer, group)])],
    }
    for name, call in calls.items():
        for mode in FAILURE_MODES:
            tensor = torch.full((4,), 5.0)
            problems += failure_problems(name, functools.partial(call, tensor), [tensor], group, mode)
    received = torch.zeros(2)
    if rank:
        comm.recv(received, peer, group)
    else:
        comm.send(torch.ones(2), peer, group)
    if rank and not torch.equal(received, torch.ones(2)):
        problems.append("the next receive after failures was wrong")
    return problems


def test_staging_failure_leaves_the_receivers_tensor_unchanged():
    assert run_ranks(_failures_leave_tensors_unchanged, 2, backend="hccl", simulate=NPU) == [[], []]
