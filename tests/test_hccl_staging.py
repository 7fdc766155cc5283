"""comm on the simulated hccl as HCCL behaves: the acceptance cases of issue 28.

On two simulated NPUs under ``comm.patch()``, CPU tensors on the hccl group must give
what torch gives with gloo (the reference each case computes by hand or on a gloo
group), or a clear error before anything is written.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import comm
import comm.testing

from multiproc import NPU, error_of, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))


def _values(rank, numel, dtype=torch.float32):
    return torch.arange(numel, dtype=dtype) * (rank + 1) + rank


def _coalesced_blocks(rank, group):
    """A _coalescing_manager block of two and of three CPU all-reduces, sync and async: what each gave."""
    gloo = dist.new_group([0, 1], backend="gloo")
    differences = []
    for count in (2, 3):
        for async_ops in (False, True):
            tensors = [_values(rank, n + 2) for n in range(count)]
            reference = [t.clone() for t in tensors]
            with _coalescing_manager(group, device=torch.device("cpu"), async_ops=async_ops) as manager:
                for tensor in tensors:
                    dist.all_reduce(tensor, group=group)
            if async_ops:
                manager.wait()
            for tensor in reference:
                dist.all_reduce(tensor, group=gloo)
            if not all(torch.equal(a, b) for a, b in zip(tensors, reference)):
                differences.append(f"{count} all-reduces, async={async_ops}: {tensors} != {reference}")
    return differences


def _acceptance(rank, world_size):
    comm.patch()
    try:
        group = dist.group.WORLD
        gloo = dist.new_group([0, 1], backend="gloo")
        seen = {"coalescing": _coalesced_blocks(rank, group)}
        # float64 on the hccl group: HCCL cannot reduce it; gloo's values, in float64.
        metric = torch.tensor([0.1 * (rank + 1), 1e-17], dtype=torch.float64)
        expected = metric.clone()
        dist.all_reduce(metric)
        dist.all_reduce(expected, group=gloo)
        seen["float64 all_reduce"] = (metric.dtype, torch.equal(metric, expected))
        # bool reduce_scatter: HCCL casts bool only in allreduce and reduce.
        flags = torch.tensor([rank == 0, False, True, rank == 1])
        out, expected = torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)
        dist.reduce_scatter_tensor(out, flags)
        dist.reduce_scatter_tensor(expected, flags, group=gloo)
        seen["bool reduce_scatter"] = (out.tolist(), expected.tolist())
        # all_gather_coalesced: HCCL has none; comm runs one flat gather.
        inputs = [_values(rank, 3), _values(rank, 2).reshape(1, 2)]
        outputs = [[torch.zeros_like(t) for t in inputs] for _ in range(world_size)]
        dist.all_gather_coalesced(outputs, inputs)
        seen["all_gather_coalesced"] = [[t.tolist() for t in lists] for lists in outputs]
        # recv with no source: HCCL cannot; a clear error naming the backend, nothing written.
        into = torch.full((2,), 7.0)
        seen["recv any source"] = (error_of(dist.recv, into), into.tolist())
        # integer AVG: hccl averages integers itself (as Ascend's tests expect); bool has no average.
        counters = torch.tensor([rank + 1, 4])
        dist.all_reduce(counters, op=dist.ReduceOp.AVG)
        flags = torch.tensor([True, False])
        seen["integer avg"] = (counters.tolist(), error_of(lambda: dist.all_reduce(flags, op=dist.ReduceOp.AVG)),
                               flags.tolist())
        seen["stats"] = comm.stats()
        return seen
    finally:
        comm.unpatch()


@pytest.fixture(scope="module")
def acceptance():
    return run_ranks(_acceptance, 2, backend="hccl", simulate=NPU)


def test_coalescing_manager_blocks_of_cpu_all_reduces_give_torchs_values(acceptance):
    for seen in acceptance:
        assert seen["coalescing"] == []


def test_float64_cpu_all_reduce_on_hccl_gives_gloos_values(acceptance):
    for seen in acceptance:
        assert seen["float64 all_reduce"] == (torch.float64, True)


def test_bool_reduce_scatter_on_hccl_gives_gloos_values(acceptance):
    for rank, seen in enumerate(acceptance):
        got, expected = seen["bool reduce_scatter"]
        assert got == expected == [[True, False], [True, True]][rank]


def test_all_gather_coalesced_of_cpu_tensors(acceptance):
    expected = [[_values(r, 3).tolist(), _values(r, 2).reshape(1, 2).tolist()] for r in range(2)]
    for seen in acceptance:
        assert seen["all_gather_coalesced"] == expected
        assert seen["stats"]["all_gather_coalesced"]["staged_calls"] == 1


def test_recv_without_a_source_is_refused_clearly(acceptance):
    for rank, seen in enumerate(acceptance):
        error, untouched = seen["recv any source"]
        assert f"a receive from any source (src=None) cannot be staged onto npu:{rank}" in error
        assert "the group's backend there, hccl, cannot receive from any source; name the sender" in error
        assert untouched == [7.0, 7.0]


def test_integer_avg_is_staged_onto_hccl_which_averages_integers(acceptance):
    for seen in acceptance:
        averaged, bool_error, untouched = seen["integer avg"]
        assert averaged == [1, 4]  # (1 + 2) // 2 and (4 + 4) // 2: floor, as Ascend's tests compute
        assert "Cannot use ReduceOp.AVG with boolean inputs" in bool_error and untouched == [True, False]


def _integer_avg_on_a_communicator_named_nccl(rank, world_size):
    """comm hands an integer AVG to a communicator that averages integers itself (nccl) rather than refusing it."""
    import datetime

    from comm._native import SIMULATED, STAGING
    from comm.gaps import AVERAGES_INTEGERS

    store = dist.FileStore(__import__("os").environ["COMM_TEST_STORE"] + "-nccl", world_size)
    host = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=30))
    # blocking wait (1): the divide's error raises from wait() rather than going to the watchdog
    named_nccl = SIMULATED.load().make_backend(host, "nccl", {}, True, 1)
    staging = STAGING.load().staging_backend(rank, world_size, torch.device("npu", rank), None,
                                             datetime.timedelta(seconds=30), lambda timeout: named_nccl,
                                             averages_integers=set(AVERAGES_INTEGERS))
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.AVG
    # gloo underneath then divides in floating point: its error, not comm's refusal, says AVG reached it.
    return error_of(lambda: staging.allreduce([torch.tensor([1, 2])], options).wait())


def test_integer_avg_goes_to_a_backend_that_averages_integers():
    for error in run_ranks(_integer_avg_on_a_communicator_named_nccl, 2, backend="hccl", simulate=NPU):
        assert "cannot be staged" not in error and "can't be cast to the desired output type Long" in error


# ---- what staging costs the device (issue 29) --------------------------------------------

LATE = 1.5  # seconds rank 1 holds back its side of a collective, so that rank 0's is still running


def _sync_counts(rank):
    """What the rank's device counted (a new thread starts on device 0, whatever the rank's)."""
    from comm.testing import device_counters

    return {key: value for key, value in device_counters(rank).items() if key in ("host_syncs", "drains")}


def _staged_cost(rank, world_size):
    """Host synchronisations and compute-stream drains of staged all_reduces, and how soon get_future() returns."""
    import threading
    import time

    from comm.testing import reset_counters

    with comm.patched():
        seen = {}
        total = sum(_values(r, 4096) for r in range(world_size))
        dist.all_reduce(torch.zeros(1))  # the first call makes the communicator
        # On the group's thread, with a device collective queued on the caller's stream
        # (rank 1 joins it late): the staged call must not wait for that stream.
        busy = torch.ones(1, device=f"npu:{rank}")
        if rank == 1:
            time.sleep(LATE)
        dist.all_reduce(busy)
        reset_counters()
        tensor = _values(rank, 4096)
        dist.all_reduce(tensor)
        seen["group's thread"] = (_sync_counts(rank), torch.equal(tensor, total))
        # From another thread, on comm's own communicator.
        done = {}

        def reduce_in_thread():
            reset_counters()
            other = _values(rank, 4096)
            dist.all_reduce(other)
            done["counts"] = (_sync_counts(rank), torch.equal(other, total))

        thread = threading.Thread(target=reduce_in_thread)
        thread.start()
        thread.join()
        seen["another thread"] = done["counts"]
        # get_future() returns while the collective still waits for rank 1.
        tensor = _values(rank, 8)
        if rank == 1:
            time.sleep(LATE)
        work = dist.all_reduce(tensor, async_op=True)
        start = time.monotonic()
        future = work.get_future()
        seen["get_future seconds"] = time.monotonic() - start
        seen["future's value"] = torch.equal(future.wait()[0], sum(_values(r, 8) for r in range(world_size)))
        return seen


@pytest.fixture(scope="module")
def staged_cost():
    return run_ranks(_staged_cost, 2, backend="hccl", simulate=NPU)


def test_a_staged_all_reduce_synchronises_the_host_once_and_drains_nothing(staged_cost):
    """The copy in is queued from pinned memory (no host wait); the write-back waits once, on comm's stream, for the
    collective and its copy back: never for the caller's compute stream (drains count blocking copies that found
    queued work there)."""
    for seen in staged_cost:
        for thread in ("group's thread", "another thread"):
            counts, right = seen[thread]
            assert right, thread
            assert counts == {"host_syncs": 1, "drains": 0}, thread


def test_get_future_returns_before_the_collective_ends(staged_cost):
    """A staged call's future is completed by comm's completion thread: get_future() itself never waits."""
    assert staged_cost[0]["get_future seconds"] < LATE / 2
    assert all(seen["future's value"] for seen in staged_cost)


def _pipelined(rank, world_size):
    """All-reduces of host tensors above and below the chunk size (COMM_STAGING_CHUNK_BYTES=4096: 1,024 floats)."""
    with comm.patched():
        seen = {}
        for numel, op in ((10_000, dist.ReduceOp.SUM), (10_000, dist.ReduceOp.AVG), (2_000, dist.ReduceOp.SUM)):
            tensor = _values(rank, numel)
            expected = sum(_values(r, numel) for r in range(world_size))
            if op == dist.ReduceOp.AVG:
                expected = expected / world_size
            before = comm.stats().get("all_reduce", {}).get("staged_calls", 0)
            dist.all_reduce(tensor, op=op)
            calls = comm.stats()["all_reduce"]["staged_calls"] - before
            seen[(numel, str(op))] = (calls, torch.allclose(tensor, expected))
        comm.testing.reset_counters()
        dist.all_reduce(_values(rank, 10_000))
        seen["chunked counts"] = _sync_counts(rank)  # ten collectives, one wait for the last copies back
        tensor = _values(rank, 10_000)
        future = dist.all_reduce(tensor, async_op=True).get_future()
        seen["future"] = torch.equal(future.wait()[0], sum(_values(r, 10_000) for r in range(world_size)))
        # The last chunk's collective fails on the device (reported by wait()): no chunk is written back.
        tensor = _values(rank, 10_000)
        comm.testing.fail_next("fail_wait", calls=1, after=9)
        error = error_of(dist.all_reduce, tensor)
        seen["a failed chunk"] = ("injected backend failure" in error, torch.equal(tensor, _values(rank, 10_000)))
        return seen


def test_a_large_host_all_reduce_runs_in_pipelined_chunks():
    """At least twice the chunk size: one staged all-reduce per chunk (10,000 floats in 1,024s: 10), torch's values,
    AVG too, one host synchronisation for all; below it, one call; the work's future holds the whole tensor; a
    chunk that fails leaves the whole tensor as it was."""
    env = {"COMM_STAGING_CHUNK_BYTES": "4096"}
    for seen in run_ranks(_pipelined, 2, backend="hccl", simulate=NPU, env=env):
        assert seen[(10_000, str(dist.ReduceOp.SUM))] == (10, True)
        assert seen[(10_000, str(dist.ReduceOp.AVG))] == (10, True)
        assert seen[(2_000, str(dist.ReduceOp.SUM))] == (1, True)
        assert seen["future"]
        assert seen["a failed chunk"] == (True, True)
        assert seen["chunked counts"] == {"host_syncs": 1, "drains": 0}


# Each call comm runs in chunks, as (the tensors it takes for `numel` elements per rank, in torch's argument order,
# and the function). The tensor holding values comes last; an output before it starts as zeros.
_CHUNKED = {
    "all_reduce": lambda rank, size, numel, dtype, op, root: ([_values(rank, numel, dtype)],
                                                              lambda t: dist.all_reduce(t, op=op)),
    "broadcast": lambda rank, size, numel, dtype, op, root: ([_values(rank, numel, dtype)],
                                                             lambda t: dist.broadcast(t, src=root)),
    "reduce": lambda rank, size, numel, dtype, op, root: ([_values(rank, numel, dtype)],
                                                          lambda t: dist.reduce(t, dst=root, op=op)),
    "all_gather_into_tensor": lambda rank, size, numel, dtype, op, root: (
        [torch.zeros(size * numel, dtype=dtype), _values(rank, numel, dtype)], dist.all_gather_into_tensor),
    "reduce_scatter_tensor": lambda rank, size, numel, dtype, op, root: (
        [torch.zeros(numel, dtype=dtype), _values(rank, size * numel, dtype)],
        lambda out, t: dist.reduce_scatter_tensor(out, t, op=op)),
}
_CHUNKED_CASES = [(name, dtype, op, root) for name in _CHUNKED
                  for dtype, op, root in ((torch.float32, dist.ReduceOp.SUM, 0), (torch.bfloat16, dist.ReduceOp.MAX, 1),
                                          (torch.int64, dist.ReduceOp.AVG, 1))]


def _chunked_against_served(rank, world_size):
    """Each chunked call on CPU tensors of 10,001 elements (COMM_STAGING_CHUNK_BYTES=4096) beside the same call on
    the same values on the NPU, which the group's own hccl runs whole: each tensor afterwards, and the staged calls."""
    seen = {}
    with comm.patched():
        for name, dtype, op, root in _CHUNKED_CASES:
            tensors, call = _CHUNKED[name](rank, world_size, 10_001, dtype, op, root)
            served = [t.to(f"npu:{rank}") for t in tensors]
            call(*served)
            before = comm.stats().get(name, {}).get("staged_calls", 0)
            call(*tensors)
            calls = comm.stats()[name]["staged_calls"] - before
            if name == "reduce" and rank != root:  # torch leaves what the other ranks' tensors hold unspecified
                tensors, served = [], []
            seen[(name, str(dtype), str(op))] = (calls, all(torch.equal(t, s.cpu()) for t, s in zip(tensors, served)))
    return seen


def test_each_chunked_call_writes_what_the_served_call_writes():
    """broadcast, reduce, all_reduce, all_gather_into_tensor and reduce_scatter_tensor of host tensors in chunks
    (float32 SUM, bfloat16 MAX, int64 AVG; roots 0 and 1): bit for bit what hccl's own call on the NPU writes (a
    reduce's destination only), in more than one staged collective."""
    for seen in run_ranks(_chunked_against_served, 2, backend="hccl", simulate=NPU,
                          env={"COMM_STAGING_CHUNK_BYTES": "4096"}):
        assert all(right for _, right in seen.values()), {k: v for k, v in seen.items() if not v[1]}
        assert all(calls > 2 for calls, _ in seen.values()), seen
