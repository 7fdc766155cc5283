"""Faults, concurrency and memory: a shim under every training step must not hang or leak."""

import gc
import os
import signal
import threading
import time
import tracemalloc
import weakref

import pytest
import torch
import torch.distributed as dist

import comm
import comm.slot

from faults import late_peer
from multiproc import NPU, in_one_rank, run_ranks

PG_TIMEOUT = 5.0


def _killed_mid_loop(rank, world_size, on_npu_group):
    value = torch.ones(4)  # on the hccl group a CPU tensor takes the staging path
    for step in range(200):
        if rank == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            comm.all_reduce(value)
        except Exception as error:  # noqa: BLE001 - reported to the parent for checking
            return {"step": step, "type": type(error).__name__, "module": type(error).__module__,
                    "message": str(error), "notes": getattr(error, "__notes__", []),
                    "seconds": time.monotonic() - start}
    return None


def _check_survivor(report, staged):
    assert report is not None, "the survivor never saw the failure"
    assert report["step"] == 20
    assert report["type"] in ("RuntimeError", "DistBackendError", "DistNetworkError")  # torch's error, not comm's
    assert not report["message"].startswith("comm")
    assert report["seconds"] < PG_TIMEOUT + 10
    if staged:
        assert report["message"].endswith(
            "comm staged all_reduce: 1 tensor(s), 16 bytes, cpu -> npu:0; the caller's tensors were not written")


def test_a_killed_rank_fails_the_survivor_on_gloo():
    survivor, _ = run_ranks(_killed_mid_loop, 2, args=(False,), pg_timeout=PG_TIMEOUT, expect_dead=[1], timeout=60)
    _check_survivor(survivor, staged=False)


def test_a_killed_rank_fails_the_survivor_through_the_staging_path():
    """Under HCCL's blocking wait, where wait() raises: by default HCCL's watchdog ends the survivor instead
    (tests/test_simulated_hccl.py, test_a_failed_collective_tears_the_process_down_by_default)."""
    survivor, _ = run_ranks(_killed_mid_loop, 2, backend="hccl", simulate=NPU, args=(True,),
                            env={"TORCH_HCCL_BLOCKING_WAIT": "1"}, pg_timeout=PG_TIMEOUT, expect_dead=[1], timeout=60)
    _check_survivor(survivor, staged=True)


# A peer that joins the group, then comes to a call long after the group's timeout: rank 0 must end within
# the timeout and a few seconds (process start and the watchdog's poll aside), staged as on the served road.
LATE_TIMEOUT, LATE, SLACK = 5.0, 30.0, 4.0


# On torch 2.9.1 (CI's release tier) the staged send to a late peer on hccl returns once gloo, under the simulated
# hccl, has written its 16 bytes, where the served send is torn down by the simulated watchdog at the timeout: a
# difference of the simulation's two roads on that release that is not understood yet (on 2.13 both are torn down).
_SEND_ON_TORCH_2_9 = pytest.mark.xfail(torch.__version__.startswith("2.9."), strict=False,
                                       reason="torch 2.9: the staged send returns where the served one is torn down")


@pytest.mark.integration
@pytest.mark.parametrize("backend,scenario", [("hccl", "staged_from_thread"), ("hccl", "float64"),
                                              ("gloo", "staged_from_thread"),
                                              pytest.param("hccl", "staged_send", marks=_SEND_ON_TORCH_2_9),
                                              ("gloo", "staged_send")])
def test_a_late_peer_ends_a_staged_call_within_the_groups_timeout(backend, scenario):
    """Staged from another thread (comm's communicator of the group's kind), as float64 on hccl (comm's gloo
    communicator) or as a send (p2p), rank 0 ends within the group's timeout as the served call does (the oracle:
    on hccl the watchdog tears the process down, on gloo the call raises). Before, comm's communicators took
    torch's default of 30 minutes."""
    served = late_peer(backend, "served_send" if scenario.endswith("send") else "served", LATE_TIMEOUT, LATE)
    staged = late_peer(backend, scenario, LATE_TIMEOUT, LATE)
    assert served["seconds"] < LATE_TIMEOUT + SLACK, served
    assert staged["seconds"] < LATE_TIMEOUT + SLACK, staged
    # It ended as the served call ends: raised or torn down where that one was (torch 2.13's gloo send waits
    # for the peer, so both are torn down; torch 2.9's returns once its bytes are written, so both return).
    assert ended_by_error(staged) == ended_by_error(served), (served, staged)


def ended_by_error(outcome):
    """Whether a late peer's rank 0 ended in an error: its call raised, or its process was torn down."""
    return outcome["how"].startswith("raised") or outcome["exit"] != 0


def _staging_timeout_of_a_group_made_with(seconds):
    """The timeout comm's backend on a new hccl group holds (and hands each communicator it makes)."""
    import datetime

    from comm._native import STAGING

    group = dist.new_group([0], backend="hccl", timeout=datetime.timedelta(seconds=seconds))
    try:
        comm.equip(group)
        backend = group._get_backend(torch.device("cpu"))
        held = STAGING.load().backend_timeout(backend)
        group.set_timeout(datetime.timedelta(seconds=seconds + 1))  # reaches comm's backend too, as c10d's own
        return held.total_seconds(), STAGING.load().backend_timeout(backend).total_seconds()
    finally:
        dist.destroy_process_group(group)


def test_comms_backend_takes_the_groups_timeout():
    """The simulated hccl keeps options as ProcessGroupHCCL does; comm reads the group's timeout there."""
    assert in_one_rank(_staging_timeout_of_a_group_made_with, 7) == (7.0, 8.0)


THREADS, CALLS = 4, 500


STAGED = THREADS * len(range(0, CALLS, 3))  # every third call moves CPU data onto the NPU


def _threads_on_their_own_groups(rank, world_size):
    hccl_groups = [dist.new_group([0, 1], backend="hccl") for _ in range(THREADS)]
    gloo_groups = [dist.new_group([0, 1], backend="gloo") for _ in range(THREADS)]
    comm.reset_stats()
    wrong = []

    def worker(index):
        # Each thread on a stream of its own, as concurrent groups need on hardware. On the
        # device's default stream, which threads share (torch_npu as CUDA), work.wait()
        # makes that stream wait for the collective, and every blocking copy (comm's
        # staging copies, tensor.cpu()) synchronises it: one thread's copy then waits for
        # the collectives of other threads' groups, and ranks whose threads run in different
        # orders wait on each other for ever. torch says as much (new_group's "Safe
        # concurrent usage": threads that issue collectives must order them across ranks,
        # and async work must be waited for before another group is used); the simulated
        # NPU deadlocks on this test without the streams, as hardware can.
        with torch.npu.stream(torch.npu.Stream(f"npu:{rank}")):
            _issue_and_check(index)

    def _issue_and_check(index):
        pending = []
        for call in range(CALLS):
            value = float(index * 10_000 + call)
            # staged, native on the NPU, and the fast path (plain CPU tensors on gloo) in turn
            device, group = [("cpu", hccl_groups), (f"npu:{rank}", hccl_groups), ("cpu", gloo_groups)][call % 3]
            tensor = torch.full((2,), value + rank, device=device)
            pending.append((tensor, 2 * value + 1, comm.all_reduce(tensor, group=group[index], async_op=True)))
        for tensor, expected, work in pending:
            work.wait()
            if not torch.equal(tensor.cpu(), torch.full((2,), expected)):
                wrong.append((index, expected, tensor.cpu().tolist()))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = comm.stats()["all_reduce"]
    cached = [comm.device_types(g) for g in hccl_groups]
    return wrong, stats, cached


def test_four_threads_each_issuing_500_async_calls():
    for wrong, stats, cached in run_ranks(_threads_on_their_own_groups, 2, backend="hccl", simulate=NPU,
                                          timeout=300):
        assert wrong == []
        assert stats["staged_calls"] == STAGED  # every staged call counted once, from every thread
        assert stats["bytes_staged"] == STAGED * 2 * (2 * 4)  # 8 bytes in, 8 back
        assert cached == [frozenset({"cpu", "npu"})] * THREADS  # each group equipped once


def _tensor_count():
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _growth(call, calls=10_000):
    """Bytes of Python memory still held after ``calls`` more calls, once warmed up.

    torch keeps a bounded rolling window of small objects that takes a few thousand
    calls to fill, and objects made before tracing count as new once reallocated:
    warm up untraced, then traced, before the measured calls.
    """
    for _ in range(3_000):
        call()
    tracemalloc.start()
    for _ in range(3_000):
        call()
    gc.collect()
    before, tensors, objects = tracemalloc.get_traced_memory()[0], _tensor_count(), len(gc.get_objects())
    for _ in range(calls):
        call()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"bytes": after - before, "tensors": _tensor_count() - tensors, "objects": len(gc.get_objects()) - objects}


def _memory_over_many_calls():
    value = torch.ones(16)
    gloo = dist.new_group([0], backend="gloo")
    seen = {
        "native": _growth(lambda: comm.all_reduce(value, group=gloo)),
        "staged": _growth(lambda: comm.all_reduce(value)),
    }
    dist.destroy_process_group(gloo)
    group = dist.new_group([0], backend="hccl")
    comm.all_reduce(torch.ones(1), group=group)
    seen["cached_with_group"] = comm.slot.cached_groups()
    dist.destroy_process_group(group)
    del group
    gc.collect()
    seen["cached_after"] = comm.slot.cached_groups()
    # A staged call's work handle must not keep its group alive: whichever thread
    # drops the last reference runs the group's destructor, and on a backend thread
    # (a future's callback) that destructor joins the thread it runs on and aborts.
    group = dist.new_group([0], backend="hccl")
    work = comm.all_reduce(torch.ones(2), group=group, async_op=True)  # a CPU tensor on hccl: staged
    work.get_future().wait()
    collected = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    seen["work_holds_group"] = collected() is not None
    seen["work_result"] = work.result()[0].tolist()
    return seen


def test_ten_thousand_calls_do_not_grow_memory():
    seen = in_one_rank(_memory_over_many_calls, timeout=600)
    for path in ("native", "staged"):
        # Tensors and gc-tracked objects: exact. Bytes: tracemalloc sees tens of KB of
        # churn from torch and the simulated device (measured: the same copies and
        # reduce without comm hold ~2.6 B per call); holding even one object per call
        # would be >= 280 KB here, so the bound is below one pointer per call.
        assert seen[path]["tensors"] == 0 and seen[path]["objects"] <= 10, seen
        assert seen[path]["bytes"] < 10_000 * 8, seen
    assert seen["cached_after"] == seen["cached_with_group"] - 1  # the destroyed group is forgotten
    assert not seen["work_holds_group"] and seen["work_result"] == [1.0, 1.0]


_FAILED_CALL = r"""
import sys, time, torch, torch.distributed as dist
import comm, comm.testing
call, device = sys.argv[1], sys.argv[2]  # device "npu:0": served, the oracle; "cpu": comm stages it
comm.testing.simulate_accelerator("npu", "hccl", device_count=1)
dist.init_process_group("hccl", rank=0, world_size=1, store=dist.HashStore(), device_id=torch.device("npu:0"))
comm.equip()
tensor = torch.ones(2, device=device)
output = [torch.full((2,), 5.0, device=device)]  # what an all-gather writes
run = {"all_reduce": lambda: dist.all_reduce(tensor), "all_gather": lambda: dist.all_gather(output, tensor)}[call]
run()
output[0].fill_(5.0)  # as it was before the failed call
comm.testing.fail_next("fail_async")
try:
    run()
    print("returned", tensor.tolist(), output[0].tolist(), flush=True)
except RuntimeError as error:
    print("raised", str(error).splitlines()[0], tensor.tolist(), output[0].tolist(), flush=True)
time.sleep(1)  # the watchdog's time to act
print("survived", flush=True)
"""


def _failed_call(env, call="all_reduce", device="cpu"):
    """A one-rank hccl group whose ``call``'s collective fails as HCCL reports it by default, on ``device``."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _FAILED_CALL, call, device], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300)


def test_a_staged_call_whose_collective_fails_on_hccl_ends_the_process_by_default():
    """HCCL's default: wait() does not raise, the watchdog tears the process down (docs/staging.md)."""
    done = _failed_call({})
    assert done.returncode != 0 and "survived" not in done.stdout
    assert "injected backend failure (on wait)" in done.stderr


@pytest.mark.parametrize("call", ["all_reduce", "all_gather"])
def test_without_hccls_async_error_handling_a_failed_staged_call_leaves_what_the_served_one_leaves(call):
    """HCCL_ASYNC_ERROR_HANDLING=0: nothing raises, on the served road (the oracle) as staged, and the process
    lives on. The served all-reduce leaves the failed collective's garbage in its tensor, in place; staged, comm
    writes back its copy, which began as the caller's data: the same garbage. An all-gather's output comm stages
    in a fresh buffer: its stale contents never land (before: they did), so the caller's output stays as it was,
    where the simulated HCCL's served one holds garbage (docs/staging.md)."""
    served = _failed_call({"HCCL_ASYNC_ERROR_HANDLING": "0"}, call, "npu:0")
    staged = _failed_call({"HCCL_ASYNC_ERROR_HANDLING": "0"}, call, "cpu")
    for done in (served, staged):
        assert done.returncode == 0, done.stderr
    # Only the script's lines: torch 2.9's gloo prints its connection count on stdout too.
    served, staged = (_printed(done.stdout) for done in (served, staged))
    if call == "all_reduce":
        assert staged == served == ["returned [nan, nan] [5.0, 5.0]", "survived"]
    else:
        assert served == ["returned [1.0, 1.0] [nan, nan]", "survived"]
        assert staged == ["returned [1.0, 1.0] [5.0, 5.0]", "survived"]


def _printed(stdout):
    return [line for line in stdout.splitlines() if line.startswith(("returned", "survived"))]


def test_under_hccls_blocking_wait_a_staged_call_whose_collective_fails_writes_nothing():
    """TORCH_HCCL_BLOCKING_WAIT=1: wait() raises and comm writes nothing back."""
    done = _failed_call({"TORCH_HCCL_BLOCKING_WAIT": "1"})
    assert done.returncode == 0, done.stderr
    assert "raised injected backend failure (on wait)" in done.stdout and "[1.0, 1.0]" in done.stdout
