"""comm/csrc/mixed_devices.cpp: the one stager of calls whose tensors lie on the CPU and the accelerator.

On an equipped group, a call that mixes device types, whether torch's own or comm's
explicit one, is staged by comm's C++ kernel in front of c10d's: each tensor not on
the device type the group's own backend serves is copied there once and its result
copied back once. Checked on a group of each kind (hccl, an nccl-like accelerator
backend, gloo) on two simulated NPUs, by values against the same call with every
tensor on the group's own device, by the simulated device's transfer counter (one
round trip per such tensor, never two), and by comm.stats() (the C++ kernel's
entries, named for c10d's operator, and no Python staging's), under
torch.inference_mode() too.
"""

import pytest
import torch
import torch.distributed as dist

import comm
import comm.testing

from multiproc import NPU, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))

# Each group kind: how run_ranks makes it, and the device type its own backend serves.
GROUPS = {
    "hccl": (dict(backend="hccl", simulate=NPU), "npu"),
    "nccl-like": (dict(backend="ncclsim", simulate=dict(NPU, backend="ncclsim", lenient=True)), "npu"),
    "gloo": (dict(backend="gloo", simulate=NPU), "cpu"),
}


def _values(rank, device, numel=4):
    return (torch.arange(numel, dtype=torch.float32) + 10 * rank).to(device)


# Each row makes a call's tensors, outputs on `out` and inputs on `into`, on two ranks, and returns
# the call, its outputs, and how many tensors it reads and writes on each device.
def _all_gather_into_tensor(module, rank, out, into):
    output, input = torch.zeros(8, device=out), _values(rank, into)
    return lambda: module.all_gather_into_tensor(output, input), [output], {out: (0, 1), into: (1, 0)}


def _all_gather(module, rank, out, into):
    outputs, input = [torch.zeros(4, device=out) for _ in range(2)], _values(rank, into)
    return lambda: module.all_gather(outputs, input), outputs, {out: (0, 2), into: (1, 0)}


def _reduce_scatter_tensor(module, rank, out, into):
    output, input = torch.zeros(2, device=out), _values(rank, into)
    return lambda: module.reduce_scatter_tensor(output, input), [output], {out: (0, 1), into: (1, 0)}


def _gather(module, rank, out, into):
    listed = [torch.zeros(4, device=out) for _ in range(2)] if rank == 0 else None
    input = _values(rank, into)
    return (lambda: module.gather(input, listed, dst=0), listed or [],
            {out: (0, 2 if rank == 0 else 0), into: (1, 0)})


def _scatter(module, rank, out, into):
    output = torch.zeros(4, device=out)
    pieces = [_values(r, into) for r in range(2)] if rank == 0 else None
    return lambda: module.scatter(output, pieces, src=0), [output], {out: (0, 1), into: (2 if rank == 0 else 0, 0)}


ROWS = [_all_gather_into_tensor, _all_gather, _reduce_scatter_tensor, _gather, _scatter]


def _mixed_calls(rank, world_size, own):
    npu = torch.device("npu", rank)
    comm.equip()
    other = "cpu" if own == "npu" else npu
    own_device = npu if own == "npu" else "cpu"
    seen = {}
    for row in ROWS:
        call, reference, _ = row(dist, rank, own_device, own_device)
        call()
        for module in (dist, comm):
            for inference in (False, True):
                for out, into in ((own_device, other), (other, own_device)):
                    with torch.inference_mode(inference):
                        call, got, uses = row(module, rank, out, into)
                        comm.reset_stats()
                        comm.testing.reset_counters()
                        call()
                    transfers = comm.testing.counters()["transfers"]
                    foreign = uses[other]
                    label = (row.__name__[1:], module.__name__, inference, "out on " + str(out))
                    seen[label] = dict(
                        same=len(got) == len(reference) and all(
                            torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, reference)),
                        devices=sorted({str(t.device) for t in got}) == ([str(out)] if got else []),
                        transfers=(transfers, foreign[0] + foreign[1]),
                        stagers=sorted({name.endswith("(mixed devices)") for name in comm.stats()}),
                        # A rank whose call does not mix devices (gather's and scatter's other rank) and has
                        # tensors off the group's own device is staged by comm's backend in that slot.
                        mixes=all(sum(uses[device]) > 0 for device in (out, into)))
    return seen


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_mixed_call_is_staged_once_by_the_cpp_kernel(kind):
    """torch's calls and comm's, with and without inference_mode: the values of the call on the group's own
    device, one copy in per tensor read and one back per tensor written off it, and the C++ kernel alone."""
    options, own = GROUPS[kind]
    for seen in run_ranks(_mixed_calls, 2, args=(own,), **options):
        assert len(seen) == len(ROWS) * 2 * 2 * 2
        for label, facts in seen.items():
            assert facts["same"] and facts["devices"], label
            transfers, expected = facts["transfers"]
            assert transfers == expected, (label, transfers, expected)
            stager = [True] if facts["mixes"] else [False] if expected else []
            assert facts["stagers"] == stager, (label, facts["stagers"])


def _disagreeing_all_reduce(rank, world_size):
    comm.equip()
    tensor = torch.full((64,), float(rank + 1), device="cpu" if rank == 0 else torch.device("npu", rank))
    dist.all_reduce(tensor)
    return tensor.cpu()


def test_ranks_that_disagree_on_an_all_reduces_device_still_meet():
    """docs/staging.md: a CPU all-reduce on one rank is staged onto hccl and meets the other rank's NPU one there
    (chunking off: a chunked one would not, and comm cannot tell without a collective per call)."""
    for got in run_ranks(_disagreeing_all_reduce, 2, env={"COMM_STAGING_CHUNK_BYTES": "0"}, **GROUPS["hccl"][0]):
        assert torch.equal(got, torch.full((64,), 3.0))

