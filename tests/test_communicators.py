"""The communicators comm makes: none for the group's own thread, one per group for another thread.

Staged calls from the thread that issues a group's collectives (the one that created
or equipped it) run on the group's own backend, as the fix written by hand does;
only a thread of its own (``dcp.async_save``'s) gets a communicator comm makes, with
the group's options. Counted by ``comm.slot.communicators()``, on two simulated NPUs.
"""

import os
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.distributed_c10d import _coalescing_manager

import comm
import comm._communicators
import comm.slot
from comm._releases import flat_gather

from multiproc import NPU, init_group, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))


def _values(rank, numel=6):
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank


def _summed(numel=6):
    return _values(0, numel) + _values(1, numel)


def _made(counts):
    """How many communicators comm made in all, from comm.slot.communicators()."""
    return sum(n for kinds in counts.values() for n in kinds.values())


def _staged_calls_on(group, rank):
    """CPU collectives on ``group`` from this thread, checked against torch's values; the differences."""
    problems = []
    tensor = _values(rank)
    dist.all_reduce(tensor, group=group)
    if not torch.equal(tensor, _summed()):
        problems.append(("all_reduce", tensor))
    gathered = torch.zeros(12)
    flat_gather()(gathered, _values(rank), group=group)
    if not torch.equal(gathered, torch.cat([_values(0), _values(1)])):
        problems.append(("flat all_gather", gathered))
    source = _values(rank)
    dist.broadcast(source, group_src=0, group=group)
    if not torch.equal(source, _values(0)):
        problems.append(("broadcast", source))
    tensors = [_values(rank, 3), _values(rank, 5)]
    with _coalescing_manager(group, device=torch.device("cpu"), async_ops=True) as manager:
        for each in tensors:
            dist.all_reduce(each, group=group)
    manager.wait()
    if not (torch.equal(tensors[0], _summed(3)) and torch.equal(tensors[1], _summed(5))):
        problems.append(("coalesced", tensors))
    peer = 1 - rank
    sent, received = _values(rank), torch.zeros(6)
    ops = [dist.P2POp(dist.isend, sent, group_peer=peer, group=group),
           dist.P2POp(dist.irecv, received, group_peer=peer, group=group)]
    for work in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
        work.wait()
    if not torch.equal(received, _values(peer)):
        problems.append(("send/recv", received))
    return problems


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _device_communicators(rank):
    """The HCCL communicators living on the rank's simulated NPU (the groups' own and comm's) and their memory."""
    from comm.testing import device_counters

    counted = device_counters(rank)
    return counted["communicators"], counted["communicator_bytes"]


def _mesh_and_fsdp_offload(rank, world_size):
    """Three groups under comm.patch() (a DeviceMesh's, two new_group's), then an FSDP2 offload step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    comm.patch()
    try:
        init_group("hccl", rank, world_size, device_id=torch.device("npu", rank))
        mesh = init_device_mesh("npu", (world_size,), mesh_dim_names=("dp",))
        groups = {"dp": mesh.get_group("dp"), "tp": dist.new_group([0, 1]), "pp": dist.new_group([0, 1])}
        seen = {"groups": len({g.group_name for g in groups.values()}),
                "problems": {name: _staged_calls_on(group, rank) for name, group in groups.items()}}
        seen["after staged calls"] = comm.slot.communicators()
        seen["device after staged calls"] = _device_communicators(rank)
        model = _model()
        for module in [model[0], model[2], model]:
            fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy())
        comm.reset_stats()
        loss = model(torch.ones(2, 8, device="npu") * (rank + 1)).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # comm's under patch: CPU grads
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        seen["fsdp staged"] = sum(entry["staged_calls"] for entry in comm.stats().values())
        seen["norm"] = float(norm)
        seen["after fsdp step"] = comm.slot.communicators()
        seen["device after fsdp step"] = _device_communicators(rank)
        # A staged call from a thread of its own: comm makes one communicator, for that group only.
        from_a_thread = []
        worker = threading.Thread(target=lambda: from_a_thread.extend(_staged_calls_on(groups["tp"], rank)))
        worker.start()
        worker.join()
        seen["thread problems"] = from_a_thread
        seen["after another thread"] = comm.slot.communicators()
        seen["device after another thread"] = _device_communicators(rank)
        seen["again on the group's thread"] = _staged_calls_on(groups["tp"], rank)
        seen["finally"] = comm.slot.communicators()
        return seen
    finally:
        comm.unpatch()


@pytest.fixture(scope="module")
def mesh_and_fsdp():
    return run_ranks(_mesh_and_fsdp_offload, backend=None, simulate=NPU, timeout=300)


def test_staged_calls_from_the_groups_thread_make_no_communicator(mesh_and_fsdp):
    for seen in mesh_and_fsdp:
        assert seen["groups"] == 3
        assert seen["problems"] == {"dp": [], "tp": [], "pp": []}
        assert len(seen["after staged calls"]) == 3, seen["after staged calls"]
        assert _made(seen["after staged calls"]) == 0, seen["after staged calls"]


def test_an_fsdp2_offload_step_makes_no_communicator(mesh_and_fsdp):
    for seen in mesh_and_fsdp:
        assert seen["fsdp staged"] > 0  # the step staged (the norm of CPU gradients) ...
        assert _made(seen["after fsdp step"]) == 0, seen["after fsdp step"]  # ... on the groups' own hccl
        assert seen["norm"] > 0
        # The device holds the groups' own communicators only, before the step and after it.
        assert seen["device after fsdp step"] == seen["device after staged calls"]


def test_another_threads_communicator_costs_what_hccl_charges(mesh_and_fsdp):
    """comm's one communicator, on HCCL: a collective communicator with its HCCL_BUFFSIZE (200 MiB by default) and,
    for the thread's send and receive, a point-to-point one with 2 x P2P_HCCL_BUFFSIZE (40 MiB); nothing else."""
    for seen in mesh_and_fsdp:
        (before, held), (after, now) = seen["device after fsdp step"], seen["device after another thread"]
        assert (after - before, now - held) == (2, (200 + 40) << 20)
        print(f"\nrank's device: {before} communicators, {held >> 20} MiB before; {after}, {now >> 20} MiB after")


def test_another_thread_gets_one_communicator_of_the_groups_kind(mesh_and_fsdp):
    for seen in mesh_and_fsdp:
        assert seen["thread problems"] == []
        counts = seen["after another thread"]
        assert _made(counts) == 1, counts
        assert [kinds["hccl"] for kinds in counts.values() if kinds.get("hccl")] == [1]
        assert seen["again on the group's thread"] == []
        assert seen["finally"] == counts  # the group's thread goes on without one


def _async_save_while_reducing(rank, world_size):
    """dcp.async_save's thread stages its planning collectives while the training thread stages reductions."""
    comm.patch()
    try:
        init_group("hccl", rank, world_size, device_id=torch.device("npu", rank))
        path = os.environ["COMM_TEST_STORE"] + "-checkpoint"
        state = {"weight": _values(rank, 64), "step": torch.tensor(7)}
        before = comm.slot.communicators()
        future = dcp.async_save(state, checkpoint_id=path)
        wrong, reduced, busy = [], 0, True
        while busy or reduced < 20:  # the training thread keeps staging on the group meanwhile
            tensor = _values(rank)
            dist.all_reduce(tensor)
            if not torch.equal(tensor, _summed()):
                wrong.append(tensor)
            pair = [_values(rank, 3), _values(rank, 4)]
            with _coalescing_manager(dist.group.WORLD, device=torch.device("cpu"), async_ops=True) as manager:
                for each in pair:
                    dist.all_reduce(each)
            manager.wait()
            if not (torch.equal(pair[0], _summed(3)) and torch.equal(pair[1], _summed(4))):
                wrong.append(pair)
            still = torch.tensor([0.0 if future.done() else 1.0])
            dist.all_reduce(still)  # both ranks go on until both saves are done: the same calls on each
            busy, reduced = bool(still.item()), reduced + 1
        future.result()
        loaded = {"weight": torch.zeros(64), "step": torch.tensor(0)}
        dcp.load(loaded, checkpoint_id=path)
        return {"wrong": wrong, "loaded": loaded, "before": before, "after": comm.slot.communicators()}
    finally:
        comm.unpatch()


def test_async_save_while_the_training_thread_reduces_gives_torchs_values():
    for seen in run_ranks(_async_save_while_reducing, backend=None, simulate=NPU, timeout=300):
        assert seen["wrong"] == []
        assert torch.equal(seen["loaded"]["step"], torch.tensor(7))
        assert torch.equal(seen["loaded"]["weight"], _values(0, 64))  # DCP saves rank 0's replicated tensor
        assert _made(seen["before"]) == 0
        assert seen["after"]["0"]["hccl"] == 1  # the default group's, made for dcp's thread


def _adopted(rank, world_size):
    """A group created on one thread and used on another: adopt_thread moves the own backend to it."""
    comm.patch()
    try:
        init_group("hccl", rank, world_size, device_id=torch.device("npu", rank))
        seen = {}

        def train():
            comm.slot.adopt_thread()
            seen["problems"] = _staged_calls_on(dist.group.WORLD, rank)

        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
        seen["counts"] = comm.slot.communicators()
        return seen
    finally:
        comm.unpatch()


def test_adopt_thread_gives_a_training_thread_the_groups_own_backend():
    for seen in run_ranks(_adopted, backend=None, simulate=NPU, timeout=120):
        assert seen["problems"] == []
        assert _made(seen["counts"]) == 0, seen["counts"]


class _Options:
    """Stands for ProcessGroupHCCL.Options: what the creator writes into, what the group tuned."""

    def __init__(self):
        self.hccl_config = {}
        self.is_high_priority_stream = False
        self.group_id = ""


def test_comms_communicator_gets_a_copy_of_the_groups_options():
    own = _Options()
    own.hccl_config = {"hccl_buffer_size": 50, "group_name": "tp", "qos_traffic_class": 3}
    own.is_high_priority_stream = True
    own.group_id = "1"
    made = comm._communicators.options_like(own, "1:comm-staging")
    assert made is not own and isinstance(made, _Options)
    assert made.hccl_config == {"hccl_buffer_size": 50, "group_name": "1:comm-staging", "qos_traffic_class": 3}
    assert made.is_high_priority_stream is True
    assert made.group_id == ""  # the creator writes the communicator's own name
    assert own.hccl_config["group_name"] == "tp"  # the group's own options are untouched
    assert comm._communicators.options_like(None, "x") is None
    assert comm._communicators.options_like(None, "x", lambda: SimpleNamespace(made=True)).made is True


def _destroyed_with_its_group(rank, world_size):
    """comm's communicator for another thread, on a group then destroyed while Python still holds the group."""
    comm.patch()
    try:
        group = dist.new_group([0, 1])
        before = _device_communicators(rank)
        tensor = _values(rank)
        worker = threading.Thread(target=lambda: dist.all_reduce(tensor, group=group))
        worker.start()
        worker.join()
        made = _device_communicators(rank)
        dist.destroy_process_group(group)  # ProcessGroup::shutdown: each backend's, comm's forwards it
        return {"made": (made[0] - before[0], made[1] - before[1]), "after destroy": _device_communicators(rank),
                "before": before, "right": torch.equal(tensor, _summed()), "group alive": group is not None}
    finally:
        comm.unpatch()


def test_destroying_a_group_shuts_comms_communicator_down():
    """destroy_process_group(group) reaches comm's communicator: HCCL's memory comes back while the group object
    lives on (without the forwarding it would wait for the group's destructor)."""
    for seen in run_ranks(_destroyed_with_its_group, 2, backend="hccl", simulate=NPU):
        assert seen["right"] and seen["group alive"]
        assert seen["made"] == (1, 200 << 20)
        assert seen["after destroy"] == seen["before"]
