"""The staging budget (comm.set_staging_budget): the device memory staged calls hold, against the fix by hand.

On two simulated NPUs (hccl group, CPU tensors), whose allocator counts allocated and
reserved memory and their peaks as torch_npu's does, and which runs out past its capacity.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import comm
import comm.testing

from multiproc import NPU, error_of, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))

MiB = 1 << 20
CHUNK = 8 * MiB  # comm's default chunk
BUDGET = 4 * CHUNK  # comm's default budget
SIZES = (4 * MiB, 16 * MiB, 64 * MiB)  # 256 MiB too in make test-torch-npu and make bench


def _filled(rank, nbytes):
    return torch.full((nbytes // 4,), float(rank + 1))


def _device_peak(run):
    """The device memory `run()` took beyond what was allocated before it."""
    torch.npu.synchronize()
    torch.npu.reset_peak_memory_stats()
    before = torch.npu.memory_allocated()
    run()
    return torch.npu.max_memory_allocated() - before


def _sum(size):
    return sum(range(1, size + 1))


def _gathered(rank, size, output, tensor):
    return all(bool(torch.all(row == r + 1)) for r, row in enumerate(output.view(size, -1)))


def _scattered(rank, size, output, tensor):
    return bool(torch.all(output == _sum(size)))


# The calls comm runs in chunks, each as (the tensors rank `rank` of `size` passes for a call of `nbytes`,
# torch.distributed's function of them, whether they hold what they should afterwards).
CALLS = {
    "all_reduce": (lambda rank, size, nbytes: (_filled(rank, nbytes),), dist.all_reduce,
                   lambda rank, size, t: bool(torch.all(t == _sum(size)))),
    "broadcast": (lambda rank, size, nbytes: (_filled(rank, nbytes),), functools.partial(dist.broadcast, src=0),
                  lambda rank, size, t: bool(torch.all(t == 1))),
    "reduce": (lambda rank, size, nbytes: (_filled(rank, nbytes),), functools.partial(dist.reduce, dst=0),
               lambda rank, size, t: bool(torch.all(t == (_sum(size) if rank == 0 else rank + 1)))),
    "all_gather_into_tensor": (lambda rank, size, nbytes: (torch.zeros(size * nbytes // 4), _filled(rank, nbytes)),
                               dist.all_gather_into_tensor, _gathered),
    "reduce_scatter_tensor": (lambda rank, size, nbytes: (torch.zeros(nbytes // 4), _filled(rank, size * nbytes)),
                              dist.reduce_scatter_tensor, _scattered),
}


def _by_hand(call, *tensors):
    """The fix by hand for CPU tensors on an hccl group: every tensor whole onto the device, the call, back."""
    staged = [t.to("npu") for t in tensors]
    call(*staged)
    for tensor, copy in zip(tensors, staged):
        tensor.copy_(copy)


def _peaks(rank, world_size, name):
    make, call, right = CALLS[name]
    seen = {}
    with comm.patched():
        for nbytes in SIZES:
            tensors = make(rank, world_size, nbytes)
            peak = _device_peak(functools.partial(call, *tensors))
            seen[nbytes] = (peak, _device_peak(functools.partial(_by_hand, call, *make(rank, world_size, nbytes))),
                            right(rank, world_size, *tensors))
            del tensors
        comm.set_staging_budget(0)  # no bound: every chunk at once, as before budgets
        tensors = make(rank, world_size, 64 * MiB)
        seen["unbounded"] = (_device_peak(lambda: call(*tensors)), right(rank, world_size, *tensors))
        comm.set_staging_budget(BUDGET)
        seen["budget"] = comm.staging_budget()
        seen["held after"] = torch.npu.memory_allocated()
    return seen


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_staged_call_holds_at_most_the_budget_and_never_more_than_the_fix(name):
    """From 16 MiB up the device holds at most the budget (four 8 MiB chunks) where the fix by hand holds the whole
    tensors (a gather's input and output); below, no more than the fix; the values are right; with the bound removed,
    every chunk at once."""
    for rank, seen in enumerate(run_ranks(_peaks, 2, backend="hccl", simulate=NPU, args=(name,), timeout=300)):
        for nbytes in SIZES:
            peak, by_hand, right = seen[nbytes]
            assert right, nbytes
            assert by_hand >= nbytes, nbytes
            assert peak <= by_hand, (nbytes, peak, by_hand)
            if nbytes >= 16 * MiB:
                assert peak <= BUDGET, (nbytes, peak)
        peak, right = seen["unbounded"]
        assert right and peak >= 64 * MiB, (rank, peak)
        assert seen["budget"] == BUDGET


def _async_broadcasts(rank, world_size, nbytes, calls):
    seen = {}
    with comm.patched():
        tensors = [torch.full((nbytes // 4,), float(i)) if rank == 0 else torch.zeros(nbytes // 4)
                   for i in range(calls)]

        def issue():
            works = [dist.broadcast(t, src=0, async_op=True) for t in tensors]
            for work in works:
                work.wait()

        seen["peak"] = _device_peak(issue)
        seen["right"] = all(bool(torch.all(t == i)) for i, t in enumerate(tensors))
        torch.npu.synchronize()  # a wait orders the device, not the host: its buffers go once the device has run
        torch.npu.empty_cache()
        seen["held after"] = (torch.npu.memory_allocated(), torch.npu.memory_reserved())
    return seen


@pytest.mark.parametrize(("nbytes", "calls"), [(1 * MiB, 100), (24 * MiB, 8)])
def test_back_to_back_async_calls_wait_instead_of_piling_up(nbytes, calls):
    """Asynchronous staged broadcasts issued back to back, waited for at the end: the device holds at most the budget
    plus the call being made (before: one staged buffer per call in flight), every rank gets the source's values, and
    nothing is held once they are waited for and the cache is emptied."""
    for rank, seen in enumerate(run_ranks(_async_broadcasts, 2, backend="hccl", simulate=NPU, args=(nbytes, calls))):
        assert seen["right"], rank
        assert seen["peak"] <= BUDGET + nbytes, (rank, seen["peak"])
        assert seen["held after"] == (0, 0), rank


def _out_of_memory(rank, world_size):
    seen = {}
    with comm.patched():
        dist.barrier()  # the communicator takes its HCCL_BUFFSIZE before the device gets smaller
        comm.testing.set_device_memory(512 * MiB)
        tensor = _filled(rank, 1 << 30)
        seen["by hand"] = error_of(lambda: tensor.to("npu"), catch=(torch.OutOfMemoryError,), typed=True)
        dist.all_reduce(tensor)
        seen["right"] = bool(torch.all(tensor == 3))
        seen["peak"] = torch.npu.max_memory_allocated()
    return seen


def test_a_1_gib_all_reduce_runs_where_the_device_has_less_free():
    """A device of 512 MiB (less HCCL's buffer): the fix by hand cannot copy a 1 GiB CPU tensor onto it (torch_npu's
    out-of-memory error); comm's staged all_reduce of it completes with the right values."""
    for seen in run_ranks(_out_of_memory, 2, backend="hccl", simulate=NPU, timeout=300):
        assert seen["by hand"].startswith("OutOfMemoryError: NPU out of memory. Tried to allocate 1024.00 MiB (NPU ")
        assert seen["right"]
        assert seen["peak"] <= BUDGET + MiB


def _bad_budget(rank, world_size):
    with comm.patched():
        return {repr(value): error_of(comm.set_staging_budget, value, catch=(ValueError,))
                for value in (-1, 1.5, True, "32")}


def test_a_budget_that_is_no_byte_count_is_refused():
    for seen in run_ranks(_bad_budget, 1, backend="hccl", simulate=NPU):
        for value, error in seen.items():
            assert "nbytes must be a whole number of bytes >= 0" in error, value


def _small_chunks(rank, world_size):
    """COMM_STAGING_CHUNK_BYTES=4096 (1,024 floats) and a budget of four chunks: 10,000 floats in 10 chunks."""
    seen = {}
    with comm.patched():
        comm.set_staging_budget(4 * 4096)
        original = torch.arange(10_000, dtype=torch.float32) * (rank + 1)
        total = sum(torch.arange(10_000, dtype=torch.float32) * (r + 1) for r in range(world_size))
        for op, expected in ((dist.ReduceOp.SUM, total), (dist.ReduceOp.AVG, total / world_size)):
            tensor = original.clone()
            before = comm.stats().get("all_reduce", {}).get("staged_calls", 0)
            work = dist.all_reduce(tensor, op=op, async_op=True)
            work.wait()
            seen[str(op)] = (comm.stats()["all_reduce"]["staged_calls"] - before, torch.allclose(tensor, expected))
        # The last chunk's collective fails on the device, reported by wait(): the six chunks waited for at the
        # call are written, the last four not.
        tensor = original.clone()
        comm.testing.fail_next("fail_wait", calls=1, after=9)
        seen["error"] = error_of(dist.all_reduce, tensor)
        seen["written"] = (torch.equal(tensor[:6 * 1024], total[:6 * 1024]),
                           torch.equal(tensor[6 * 1024:], original[6 * 1024:]))
    return seen


def test_a_chunked_all_reduce_within_its_budget_writes_chunk_by_chunk():
    """Ten chunks, four on the device at once: torch's values, SUM and AVG, ten staged collectives; a failing last
    chunk raises, with the chunks waited for before it written and the rest as they were."""
    for seen in run_ranks(_small_chunks, 2, backend="hccl", simulate=NPU, env={"COMM_STAGING_CHUNK_BYTES": "4096"}):
        assert seen[str(dist.ReduceOp.SUM)] == (10, True)
        assert seen[str(dist.ReduceOp.AVG)] == (10, True)
        assert "injected backend failure" in seen["error"]
        assert seen["written"] == (True, True)


def _many_unwaited_calls(rank, world_size, calls, sample):
    """Seconds per call of the first and the last `sample` of `calls` async all_reduces of one float, none waited
    for until the end (far below the budget: all stay in flight)."""
    import time

    tensors = [torch.ones(1) for _ in range(calls)]
    works, seconds = [], []
    with comm.patched():
        dist.all_reduce(torch.ones(1))  # the first staged call makes what later ones reuse
        for start in range(0, calls, sample):
            began = time.perf_counter()
            works.extend(dist.all_reduce(t, async_op=True) for t in tensors[start:start + sample])
            seconds.append((time.perf_counter() - began) / sample)
        for work in works:
            work.wait()
    return {"first": min(seconds[:2]), "last": min(seconds[-2:]), "right": all(t.item() == 1 for t in tensors)}


def test_a_call_costs_as_much_with_thousands_in_flight_as_with_none():
    """The budget's bookkeeping is constant per call: with 18,000 unwaited calls in flight a call costs what it did
    with none (a walk over every call in flight, as before, made the last calls several times dearer)."""
    [seen] = run_ranks(_many_unwaited_calls, 1, backend="hccl", simulate=NPU, args=(20_000, 1_000), timeout=300)
    assert seen["right"]
    assert seen["last"] < 2 * seen["first"], seen


def _failed_works_and_later_calls(rank, world_size):
    """A budget of one call: a staged all_reduce whose collective fails, waited for; another, never waited for; then
    eight calls that each make room past them."""
    seen = {}
    with comm.patched():
        comm.set_staging_budget(4096)
        comm.testing.fail_next("fail_wait")
        failed = dist.all_reduce(torch.ones(1024), async_op=True)
        seen["its wait"] = error_of(failed.wait)
        comm.testing.fail_next("fail_wait")
        unwaited = dist.all_reduce(torch.ones(1024), async_op=True)
        later = [torch.ones(1024) for _ in range(8)]
        seen["later calls"] = [error_of(dist.all_reduce, tensor) for tensor in later]
        seen["later right"] = all(bool(torch.all(tensor == world_size)) for tensor in later)
        seen["its own wait, later"] = error_of(unwaited.wait)
        seen["again"] = error_of(unwaited.wait)
        comm.set_staging_budget(BUDGET)
    return seen


def test_a_failed_call_fails_at_its_own_wait_never_in_a_later_call_that_makes_room():
    """Making room waits for earlier calls; one whose collective failed raises at its own wait(), every time, and the
    later calls that made room past it run and are right."""
    for seen in run_ranks(_failed_works_and_later_calls, 2, backend="hccl", simulate=NPU):
        assert "injected backend failure (on wait)" in seen["its wait"], seen
        assert seen["later calls"] == [None] * 8 and seen["later right"], seen
        assert "injected backend failure (on wait)" in seen["its own wait, later"], seen
        assert seen["again"] == seen["its own wait, later"], seen
