"""Batches and coalescing blocks whose tensors mix the CPU and the accelerator carry every byte.

torch opens a coalescing block (``batch_isend_irecv``, ``_coalescing_manager(group,
device)``) on the backend of one device type; on an equipped group the calls on the
other type meet comm. Checked on a group of each kind (hccl, an nccl-like accelerator
backend, gloo) on two simulated NPUs: after ``wait()`` on every work torch returns,
each receive holds its peer's values and each reduction the sum over ranks (computed
here), read without any synchronisation the same calls on one device would not need.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import comm

from multiproc import NPU, error_of, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))

GROUPS = {
    "hccl": dict(backend="hccl", simulate=NPU),
    "nccl-like": dict(backend="ncclsim", simulate=dict(NPU, backend="ncclsim", lenient=True)),
    "gloo": dict(backend="gloo", simulate=NPU),
}

# Each batch: per rank, its ops in order, as (what, device): each rank sends its values to the
# other and receives the other's; the k-th send of one rank meets the k-th receive of the other.
BATCHES = {
    "npu send, cpu recv": [[("send", "npu"), ("recv", "cpu")]] * 2,
    "cpu send, npu recv": [[("send", "cpu"), ("recv", "npu")]] * 2,
    "cpu recv, npu send": [[("recv", "cpu"), ("send", "npu")]] * 2,
    "npu recv, cpu send": [[("recv", "npu"), ("send", "cpu")]] * 2,
    "each rank its own mix": [[("send", "npu"), ("recv", "cpu")], [("recv", "npu"), ("send", "cpu")]],
    "two each way": [[("send", "npu"), ("send", "cpu"), ("recv", "cpu"), ("recv", "npu")]] * 2,
}


def _device(kind, rank):
    return torch.device("npu", rank) if kind == "npu" else torch.device("cpu")


def _sent(rank, k):
    """What ``rank`` sends in its k-th send."""
    return torch.full((4,), float(10 * (rank + 1) + k))


def _batch(rank, ops):
    """Runs one batch; returns each receive's values, read after waiting for every returned work."""
    peer = 1 - rank
    received, p2p = [], []
    sends = 0
    for what, kind in ops:
        device = _device(kind, rank)
        if what == "send":
            p2p.append(dist.P2POp(dist.isend, _sent(rank, sends).to(device), peer))
            sends += 1
        else:
            received.append(torch.zeros(4, device=device))
            p2p.append(dist.P2POp(dist.irecv, received[-1], peer))
    for work in dist.batch_isend_irecv(p2p):
        work.wait()
    return [tensor.cpu() for tensor in received]


def _batches(rank, world_size):
    comm.equip()
    seen = {}
    for label, plans in BATCHES.items():
        got = _batch(rank, plans[rank])
        expected = [_sent(1 - rank, k) for k in range(len(got))]
        seen[label] = all(torch.equal(a, b) for a, b in zip(got, expected)) or [t.tolist() for t in got]
    return seen


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_mixed_batch_receives_the_peers_values(kind):
    for rank, seen in enumerate(run_ranks(_batches, 2, **GROUPS[kind])):
        assert seen == dict.fromkeys(BATCHES, True), (rank, seen)


# Blocks of two calls each, one on each device type, opened with _coalescing_manager on the
# device `block_on` ("npu", "cpu", or None: no device, torch's fast path alone); each returns True
# where every output holds the value computed here, else what the outputs hold.
def _reduced(rank, k):
    return torch.arange(4, dtype=torch.float32) + 100 * k + rank


def _in_block(block_on, rank, async_ops, calls):
    device = _device(block_on, rank) if block_on else None
    with _coalescing_manager(device=device, async_ops=async_ops) as cm:
        works = [call() for call in calls]
    for work in cm.works + [w for w in works if w is not None]:
        work.wait()


def _checked(outputs, expected):
    outputs = [output.cpu() for output in outputs]
    return all(torch.equal(o, e) for o, e in zip(outputs, expected)) or [o.tolist() for o in outputs]


def _all_reduce_block(rank, block_on, async_ops):
    tensors = [_reduced(rank, 0), _reduced(rank, 1).to(_device("npu", rank))]
    _in_block(block_on, rank, async_ops, [lambda t=t: dist.all_reduce(t) for t in tensors])
    return _checked(tensors, [_reduced(0, k) + _reduced(1, k) for k in range(2)])


def _all_gather_block(rank, block_on, async_ops):
    """The first from the CPU into the NPU, the second the other way."""
    pairs = [(torch.zeros(8, device=_device("npu", rank)), _reduced(rank, 0)),
             (torch.zeros(8), _reduced(rank, 1).to(_device("npu", rank)))]
    _in_block(block_on, rank, async_ops, [lambda o=o, i=i: dist.all_gather_into_tensor(o, i) for o, i in pairs])
    return _checked([o for o, _ in pairs], [torch.cat([_reduced(0, k), _reduced(1, k)]) for k in range(2)])


def _reduce_scatter_block(rank, block_on, async_ops):
    """The first from the NPU into the CPU, the second the other way."""
    pairs = [(torch.zeros(2), _reduced(rank, 0).to(_device("npu", rank))),
             (torch.zeros(2, device=_device("npu", rank)), _reduced(rank, 1))]
    _in_block(block_on, rank, async_ops, [lambda o=o, i=i: dist.reduce_scatter_tensor(o, i) for o, i in pairs])
    return _checked([o for o, _ in pairs],
                    [(_reduced(0, k) + _reduced(1, k))[2 * rank:2 * rank + 2] for k in range(2)])


def _p2p_block(rank, block_on, async_ops):
    """An isend from the NPU and an irecv into the CPU."""
    peer, received = 1 - rank, torch.zeros(4)
    sent = _sent(rank, 0).to(_device("npu", rank))
    _in_block(block_on, rank, async_ops, [lambda: dist.isend(sent, peer), lambda: dist.irecv(received, peer)])
    return _checked([received], [_sent(peer, 0)])


BLOCKS = {"all_reduce": _all_reduce_block, "all_gather_into_tensor": _all_gather_block,
          "reduce_scatter_tensor": _reduce_scatter_block, "isend/irecv": _p2p_block}


def _blocks(rank, world_size, block_on):
    # torch alone, before comm equips the group: a block on the group's own device of calls on that device.
    own = "cpu" if dist.get_backend() == "gloo" else "npu"
    torchs = None
    if block_on == own:
        tensor = _reduced(rank, 0).to(_device(own, rank))
        torchs = error_of(_in_block, block_on, rank, False, [lambda: dist.all_reduce(tensor)])
    comm.equip()
    seen = {}
    for name, run in BLOCKS.items():
        for async_ops in (False, True):
            try:
                seen[name, async_ops] = run(rank, block_on, async_ops)
            except RuntimeError as error:
                seen[name, async_ops] = str(error)
    return torchs, seen


@pytest.mark.parametrize("block_on", ["npu", "cpu", None])
@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_mixed_coalescing_block_carries_every_value(kind, block_on):
    """Where torch alone refuses the block (gloo cannot coalesce on the CPU), comm refuses it alike."""
    for rank, (torchs, seen) in enumerate(run_ranks(_blocks, 2, args=(block_on,), **GROUPS[kind])):
        expected = torchs if torchs is not None else True
        assert len(seen) == 2 * len(BLOCKS)
        assert all(value == expected for value in seen.values()), (rank, torchs, seen)
