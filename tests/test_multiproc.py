"""tests/multiproc.py's one-rank worker: it serves call after call, and one call cannot spoil the next.

Each check is a pair of calls to the same worker: the first does something wrong,
the second sees that the worker answered for it and is as it was.
"""

import os

import pytest
import torch
import torch.distributed as dist

import comm
import comm.slot

from multiproc import in_one_rank


def _worker_state():
    """Who the worker is and what it holds: its process id, its groups, whether comm is patched."""
    return {"pid": os.getpid(), "groups": len(comm.slot.existing_groups()), "backend": dist.get_backend(),
            "patched": comm.is_patched(), "device": str(comm.staging_device(torch.ones(1)))}


def _fail():
    raise ValueError("meant to fail")


def _stay_patched():
    comm.patch()


def _leave_a_group():
    dist.new_group([0], backend="gloo")


def _die():
    os._exit(3)


def test_the_worker_is_one_rank_of_hccl_on_the_simulated_npu():
    first, second = in_one_rank(_worker_state), in_one_rank(_worker_state)
    assert first == second  # the same process, unchanged
    assert first["groups"] == 1 and first["backend"] == "hccl" and not first["patched"]
    assert first["device"] == "npu:0"  # a CPU tensor stages onto the bound device
    assert first["pid"] != os.getpid()


def test_a_failing_call_reports_its_traceback_and_the_worker_serves_on():
    before = in_one_rank(_worker_state)
    with pytest.raises(AssertionError, match="ValueError: meant to fail"):
        in_one_rank(_fail)
    assert in_one_rank(_worker_state) == before


@pytest.mark.parametrize("spoil, complaint", [(_stay_patched, "comm is patched"),
                                              (_leave_a_group, "1 process group")])
def test_a_call_that_leaves_the_worker_changed_fails_and_is_undone(spoil, complaint):
    before = in_one_rank(_worker_state)
    with pytest.raises(AssertionError, match=complaint):
        in_one_rank(spoil)
    assert in_one_rank(_worker_state) == before


def test_a_dead_worker_is_replaced_by_the_next_call():
    before = in_one_rank(_worker_state)
    with pytest.raises(AssertionError, match="died"):
        in_one_rank(_die)
    after = in_one_rank(_worker_state)
    assert after["pid"] != before["pid"] and after == {**before, "pid": after["pid"]}
