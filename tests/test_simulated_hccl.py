"""The simulated hccl follows torch_npu's ProcessGroupHCCL, one test per rule.

Each rule cites what it mirrors in torch_npu 2.13 / 2.9.1 (Ascend/pytorch master and
v2.9.0-26.0.0, ``torch_npu/csrc/distributed/``). The calls run on NPU tensors on two
simulated NPUs, where the group's own (simulated) hccl serves them: comm is not involved.
One scenario per simulation records every rule's outcome; each test reads its own.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import comm

from multiproc import NPU, error_of, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))

# int16 is missing: HCCL reduces it, gloo (under the simulation) does not (docs/simulated-npu.md).
REDUCIBLE = [torch.int8, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16]


def _npu(rank, values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype).to(f"npu:{rank}")


def _reduce_scatter(rank, dtype, op=ReduceOp.SUM):
    out = _npu(rank, [0], dtype)
    dist.reduce_scatter_tensor(out, _npu(rank, [rank + 1, rank + 2], dtype), op=op)
    return out.cpu()


def _all_reduce(rank, dtype, op=ReduceOp.SUM, values=None):
    tensor = _npu(rank, values if values is not None else [rank + 1, 2 * rank + 1], dtype)
    dist.all_reduce(tensor, op=op)
    return tensor.cpu()


def _rules(rank, world_size):
    seen = {}
    seen["reducible"] = {str(d): error_of(_all_reduce, rank, d) or _all_reduce(rank, d).tolist() for d in REDUCIBLE}
    seen["float64 all_reduce"] = error_of(_all_reduce, rank, torch.float64)
    seen["float64 reduce_scatter"] = error_of(_reduce_scatter, rank, torch.float64)
    seen["uint16 all_reduce"] = error_of(_all_reduce, rank, torch.uint16)
    seen["int16 all_reduce"] = error_of(_all_reduce, rank, torch.int16)
    seen["bool all_reduce"] = _all_reduce(rank, torch.bool, values=[rank == 0, False]).tolist()
    seen["uint8 all_reduce"] = _all_reduce(rank, torch.uint8, values=[200, 1]).tolist()
    seen["bool reduce_scatter"] = error_of(_reduce_scatter, rank, torch.bool)
    seen["uint8 reduce_scatter"] = error_of(_reduce_scatter, rank, torch.uint8)
    gathered = [torch.zeros(2, dtype=torch.float64, device=f"npu:{rank}") for _ in range(world_size)]
    dist.all_gather(gathered, _npu(rank, [rank, rank], torch.float64))
    flags = _npu(rank, [rank == 1], torch.bool)
    dist.broadcast(flags, 1)
    out = torch.zeros(2, dtype=torch.float64, device=f"npu:{rank}")
    dist.all_to_all_single(out, _npu(rank, [10 * rank, 10 * rank + 1], torch.float64))
    seen["moved, not reduced"] = ([t.cpu().tolist() for t in gathered], flags.cpu().tolist(), out.cpu().tolist())
    seen["bitwise"] = {op.name: error_of(_all_reduce, rank, torch.int32, op)
                       for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)}
    inputs = [_npu(rank, [rank])]
    seen["all_gather_coalesced"] = error_of(dist.all_gather_coalesced, [[torch.zeros_like(inputs[0])] * 2], inputs)
    seen["recv any source"] = error_of(dist.recv, _npu(rank, [0.0]))
    seen["avg"] = _all_reduce(rank, torch.float32, ReduceOp.AVG).tolist()
    seen["avg reduce_scatter"] = _reduce_scatter(rank, torch.float32, ReduceOp.AVG).tolist()
    seen["integer avg"] = [_all_reduce(rank, dtype, ReduceOp.AVG, values=[rank + 4, 2 * rank + 1]).tolist()
                           for dtype in (torch.int32, torch.uint8, torch.int64)]
    premul = dist._make_nccl_premul_sum(0.5)
    seen["premul_sum"] = _all_reduce(rank, torch.float32, premul).tolist()
    seen["premul_sum reduce_scatter"] = _reduce_scatter(rank, torch.float32, premul).tolist()
    seen["premul_sum int"] = error_of(_all_reduce, rank, torch.int32, premul)
    seen.update(_shapes(rank, world_size))
    return seen


def _shapes(rank, world_size):
    """What HCCL checks of shapes: element counts for the tensor gathers and scatters; uneven list gathers."""
    seen = {}
    flat = torch.zeros(4 * world_size, device=f"npu:{rank}")  # Accelerate's gather: a flat output
    dist.all_gather_into_tensor(flat, _npu(rank, [[rank, rank + 0.5], [rank + 1, rank + 1.5]]))
    scattered = torch.zeros(2, 1, device=f"npu:{rank}")
    dist.reduce_scatter_tensor(scattered, _npu(rank, [rank + 1.0, rank + 2.0, rank + 3.0, rank + 4.0]))
    seen["flat"] = (flat.cpu().tolist(), scattered.cpu().flatten().tolist())
    seen["wrong count"] = error_of(dist.all_gather_into_tensor, torch.zeros(5, device=f"npu:{rank}"),
                                   _npu(rank, [1.0, 2.0]))
    shapes = [(2, 3), (4,)]  # Ascend's test_all_gather_dist_different_shape: each rank its own shape
    mine = torch.arange(6.0 if rank == 0 else 4.0).reshape(shapes[rank]) + 100 * rank
    gathered = [torch.zeros(shape, device=f"npu:{rank}") for shape in shapes]
    dist.all_gather(gathered, mine.to(f"npu:{rank}"))
    seen["uneven"] = [tensor.cpu().tolist() for tensor in gathered]
    strided = torch.zeros(6, device=f"npu:{rank}")[::2]  # Ascend's fault case error_discontinuous_tensor
    seen["not contiguous"] = error_of(dist.all_reduce, strided)
    seen["transposed"] = error_of(dist.broadcast, torch.zeros(3, 2, device=f"npu:{rank}").t(), 0)
    seen["channels_last"] = error_of(dist.all_reduce, torch.ones(1, 2, 2, 2, device=f"npu:{rank}").contiguous(
        memory_format=torch.channels_last))  # dense in its own format: taken
    other = f"npu:{(rank + 1) % world_size}"  # Ascend's fault case error_size: inputs on another NPU
    seen["another npu"] = error_of(dist.reduce_scatter_tensor, torch.zeros(1, device=f"npu:{rank}"),
                                   torch.zeros(world_size, device=other))
    return seen


def _to_itself(rank, world_size):
    """Ascend's batch_isend_irecv tests send to and receive from the rank itself, beside its peers."""
    peer = (rank + 1) % world_size
    sent = [_npu(rank, [10.0 * rank + 1]), _npu(rank, [10.0 * rank + 2])]
    got = [torch.zeros(1, device=f"npu:{rank}") for _ in range(2)]
    ops = [dist.P2POp(dist.irecv, got[0], rank), dist.P2POp(dist.isend, sent[0], rank),  # its receive listed first
           dist.P2POp(dist.isend, sent[1], peer), dist.P2POp(dist.irecv, got[1], (rank - 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [tensor.cpu().item() for tensor in got]


def _lenient(rank, world_size):
    return {"float64": _all_reduce(rank, torch.float64).tolist(),
            "band": _all_reduce(rank, torch.int32, ReduceOp.BAND).tolist(),
            "premul_sum": error_of(_all_reduce, rank, torch.float32, dist._make_nccl_premul_sum(0.5))}


@pytest.fixture(scope="module")
def rules():
    return run_ranks(_rules, 2, backend="hccl", simulate=NPU)


def test_reductions_take_int8_to_int64_fp16_fp32_bf16(rules):
    """checkSupportedDataType's set (master:ProcessGroupHCCL.cpp:168-189; 2.9.1 :170-184), less int16."""
    for seen in rules:
        assert seen["reducible"] == {str(d): [3, 4] for d in REDUCIBLE}


def test_reductions_refuse_float64_and_unsigned_with_hccls_message(rules):
    """fp64 and uint64 only on Ascend950 (master:ProcessGroupHCCL.cpp:179-187), never on 2.9.1."""
    for seen in rules:
        assert seen["float64 all_reduce"].startswith("HCCL allreduce: Unsupported data type at::kDouble")
        assert "HCCL _reduce_scatter_base: Unsupported data type at::kDouble" in seen["float64 reduce_scatter"]
        assert "HCCL allreduce: Unsupported data type at::ScalarType::UInt16" in seen["uint16 all_reduce"]


def test_bool_and_uint8_are_cast_in_allreduce_not_in_reduce_scatters(rules):
    """The int32 cast in allreduce/allreduce_coalesced/reduce (master:ProcessGroupHCCL.cpp:4793-4796, 5070, 5153);
    none in the reduce-scatters (:5982, 6234, 6307)."""
    for seen in rules:
        assert seen["bool all_reduce"] == [True, False]
        assert seen["uint8 all_reduce"] == [144, 2]  # 400 modulo 256, as the int32 sum copied back
        assert "HCCL _reduce_scatter_base: Unsupported data type at::kByte/at::kBool" in seen["bool reduce_scatter"]
        assert "HCCL _reduce_scatter_base: Unsupported data type at::kByte/at::kBool" in seen["uint8 reduce_scatter"]


def test_broadcast_allgather_alltoall_take_every_mapped_dtype(rules):
    """"AllGather & Broadcast support all data type" (master:ProcessGroupHCCL.cpp:166): no checkSupportedDataType."""
    for rank, seen in enumerate(rules):
        assert seen["moved, not reduced"] == ([[0.0, 0.0], [1.0, 1.0]], [True], [[0.0, 10.0], [1.0, 11.0]][rank])


def test_bitwise_reductions_are_refused(rules):
    """getHcclReduceOp's unsupportedOp (master:ProcessGroupHCCL.cpp:94-97, 159-161)."""
    for seen in rules:
        assert seen["bitwise"] == {name: f"Cannot use ReduceOp.{name} with HCCL"
                                   for name in ("BAND", "BOR", "BXOR")}


def test_allgather_coalesced_is_refused_with_torchs_base_message(rules):
    """ProcessGroupHCCL does not override allgather_coalesced (2.13 wheel ProcessGroupHCCL.hpp:577-715)."""
    for seen in rules:
        assert "Backend hccl does not support allgather_coalesced" in seen["all_gather_coalesced"]


def test_receive_from_any_source_is_refused(rules):
    """ProcessGroupHCCL::recvAnysource (master:ProcessGroupHCCL.cpp:6988-6992; 2.9.1 :6652-6655)."""
    for seen in rules:
        assert seen["recv any source"] == "ProcessGroupHCCL does not support recv"


def test_avg_is_sum_then_a_divide_and_integers_average_to_integers(rules):
    """getHcclReduceOp maps AVG to SUM (master:ProcessGroupHCCL.cpp:136-141); the outputs are divided after
    (:4808-4816, 6272-6280); integers to integers, floor-divided, as Ascend's test_dist_all_reduce_avg and
    test_dist_all_reduce_uint8_avg expect (sums 9 and 4 over 2 ranks)."""
    for seen in rules:
        assert seen["avg"] == [1.5, 2.0]
        assert seen["avg reduce_scatter"] == [[1.5], [2.5]][rules.index(seen)]
        assert seen["integer avg"] == [[4, 2]] * 3


def test_tensors_must_be_contiguous_and_on_one_npu(rules):
    """check_npu_single_tensor / check_npu_tensors_different_devices: Ascend's fault cases
    error_discontinuous_tensor and error_size. A channels_last tensor is dense in its own format."""
    for seen in rules:
        assert "Tensors must be contiguous" in seen["not contiguous"]
        assert "Tensors must be contiguous" in seen["transposed"]
        assert seen["channels_last"] is None
        assert "must all reside on the same device" in seen["another npu"]


def test_a_batch_sends_to_and_receives_from_the_rank_itself():
    """Ascend's batch_isend_irecv tests include a rank's own rank as a peer: gloo has no pair to itself."""
    got = run_ranks(_to_itself, 2, backend="hccl", simulate=NPU)
    assert got == [[1.0, 12.0], [11.0, 2.0]]


def test_premul_sum_scales_then_sums(rules):
    """PREMUL_SUM: SUM of inputs scaled by double_factor (master:ProcessGroupHCCL.cpp:143-150, 4797-4806)."""
    for seen in rules:
        assert seen["premul_sum"] == [1.5, 2.0]
        assert seen["premul_sum reduce_scatter"] == [[1.5], [2.5]][rules.index(seen)]
        assert "PreMulSum Data type must be half, float, bfloat16 or double" in seen["premul_sum int"]


def test_tensor_gathers_and_scatters_check_the_element_count_not_the_shape(rules):
    for rank in rules:
        assert rank["flat"] == ([0.0, 0.5, 1.0, 1.5, 1.0, 1.5, 2.0, 2.5], [[3.0, 5.0], [7.0, 9.0]][rank is rules[1]])
        assert "output tensor size must be equal to world_size times input tensor size" in rank["wrong count"]


def test_a_list_all_gather_takes_a_shape_per_rank(rules):
    for rank in rules:
        assert rank["uneven"] == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [100.0, 101.0, 102.0, 103.0]]


def test_lenient_runs_what_gloo_runs():
    """lenient=True: the old simulation, every call as gloo runs it (for code written against it)."""
    for seen in run_ranks(_lenient, 2, backend="hccl", simulate=dict(NPU, lenient=True)):
        assert seen["float64"] == [3.0, 4.0] and seen["band"] == [0, 1]
        assert "PREMUL_SUM" in seen["premul_sum"]


# ---- completion, errors and memory, as on a device ------------------------------------------

LATE = 1.5  # seconds rank 1 holds back its side of a collective, so that rank 0's is still running


def _completion(rank, world_size):
    """Rank 1 joins each collective LATE seconds after rank 0: rank 0 sees the collective in flight."""
    import threading
    import time

    from comm.testing import device_counters, reset_counters

    seen = {}
    barrier = torch.zeros(1, device=f"npu:{rank}")

    def late():
        if rank == 1:
            time.sleep(LATE)

    # wait() returns at once; the device, not the host, waits; a copy to the CPU waits for it.
    tensor = _npu(rank, [rank + 1.0])
    late()
    work = dist.all_reduce(tensor, async_op=True)
    start = time.monotonic()
    work.wait()
    seen["wait seconds"] = time.monotonic() - start
    seen["completed after wait"] = work.is_completed()
    seen["read after wait"] = tensor.cpu().tolist()
    seen["completed after read"] = work.is_completed()
    seen["read seconds"] = time.monotonic() - start

    # No wait: the read is not ordered after the collective and finds the old values.
    dist.all_reduce(barrier)
    tensor = _npu(rank, [rank + 1.0])
    late()
    work = dist.all_reduce(tensor, async_op=True)
    seen["read without wait"] = tensor.cpu().tolist()
    work.wait()
    seen["read after a late wait"] = tensor.cpu().tolist()

    # The future is complete at enqueue; a callback's stream waits for the collective.
    dist.all_reduce(barrier)
    tensor = _npu(rank, [rank + 1.0])
    late()
    work = dist.all_reduce(tensor, async_op=True)
    future = work.get_future()
    seen["future done at once"] = future.done()
    seen["future's callback reads"] = future.then(lambda done: done.value()[0].cpu().tolist()).wait()

    # An event recorded after wait() completes with the collective; synchronize waits for it.
    dist.all_reduce(barrier)
    tensor = _npu(rank, [rank + 1.0])
    late()
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    event = torch.Event(device=f"npu:{rank}")
    event.record()
    seen["event done at once"] = event.query()
    event.synchronize()
    seen["event done after synchronize"] = event.query() and work.is_completed()

    # torch.npu.synchronize waits for what the device was told to wait for.
    dist.all_reduce(barrier)
    tensor = _npu(rank, [rank + 1.0])
    late()
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    torch.npu.synchronize()
    seen["completed after synchronize"] = work.is_completed()

    # Counters: a blocking H2D copy, a collective waited for, a blocking D2H copy that drains it.
    dist.all_reduce(barrier)
    barrier.cpu()
    reset_counters()
    tensor = torch.ones(2).to(f"npu:{rank}")
    seen["after copy in"] = device_counters()
    dist.all_reduce(tensor)
    seen["after all_reduce"] = device_counters()
    tensor.cpu()
    seen["after copy out"] = device_counters()
    tensor.cpu()
    seen["after a second copy out"] = device_counters()
    torch.npu.synchronize()
    seen["after synchronize"] = device_counters()
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    tensor.sum().item()
    seen["after item"] = device_counters()
    # A non-blocking copy is queued on the stream only from pinned memory; from pageable memory it blocks.
    reset_counters()
    tensor.copy_(torch.ones(2, pin_memory=True), non_blocking=True)
    seen["after a pinned non-blocking copy"] = device_counters()
    tensor.copy_(torch.ones(2), non_blocking=True)
    seen["after a pageable non-blocking copy"] = device_counters()

    # wait() makes the current stream wait. Threads share the default stream; a copy on
    # another stream synchronises that stream only and does not wait for the collective.
    dist.all_reduce(barrier)
    barrier.cpu()
    tensor = _npu(rank, [rank + 1.0])
    other = _npu(rank, [7.0])
    late()
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    start = time.monotonic()
    with torch.npu.stream(torch.npu.Stream(f"npu:{rank}")):
        seen["another stream reads"] = other.cpu().tolist()
        seen["another stream seconds"] = time.monotonic() - start
        seen["completed after another stream's copy"] = work.is_completed()
    copied = {}
    thread = threading.Thread(target=lambda: copied.update(read=other.cpu().tolist(), done=work.is_completed()))
    thread.start()
    thread.join()
    seen["another thread's copy on the default stream waited"] = copied["done"]
    return seen


@pytest.fixture(scope="module")
def completion():
    return run_ranks(_completion, 2, backend="hccl", simulate=NPU)


def test_wait_orders_the_device_not_the_host(completion):
    """WorkHCCL::wait makes the current stream wait for the end event and returns (master:ProcessGroupHCCL.cpp
    :1016-1021); a blocking copy to the CPU synchronises the stream first (torch_npu CopyKernel.cpp:125-160)."""
    seen = completion[0]
    assert seen["wait seconds"] < LATE / 2
    assert seen["completed after wait"] is False
    assert seen["read after wait"] == [3.0]
    assert seen["completed after read"] is True
    assert seen["read seconds"] > LATE / 2


def test_a_result_read_without_wait_is_stale(completion):
    """Nothing orders a read after a collective nobody waited for (the collective runs on HCCL's stream)."""
    seen = completion[0]
    assert seen["read without wait"] == [1.0]
    assert seen["read after a late wait"] == [3.0]


def test_the_future_is_complete_at_enqueue_and_its_callback_waits_on_the_device(completion):
    """WorkHCCL's future is marked completed at enqueue (master:ProcessGroupHCCL.cpp:4208-4212), with events on the
    HCCL stream that a callback's stream waits for (c10's Future with devices)."""
    seen = completion[0]
    assert seen["future done at once"] is True
    assert seen["future's callback reads"] == [3.0]


def test_events_and_synchronize_wait_for_what_the_device_waits_for(completion):
    """aclrtRecordEvent after a wait completes with the collective; NPUEvent.synchronize and torch.npu.synchronize
    block the host until it has."""
    seen = completion[0]
    assert seen["event done at once"] is False
    assert seen["event done after synchronize"] is True
    assert seen["completed after synchronize"] is True


def test_counters_count_host_synchronisations_and_drains(completion):
    """A blocking copy synchronises the current stream (CopyKernel.cpp:125-160): a host synchronisation, and a drain
    when the stream had a collective queued; synchronize() and item() wait on the device too. A non-blocking copy
    blocks as well unless its host memory is pinned (torch_npu's CachingHostAllocator.cpp, process_non_blocking_copy,
    synchronises the stream for unregistered host memory)."""
    for seen in completion:
        sync = {key: value for key, value in seen["after copy in"].items() if key in ("host_syncs", "drains")}
        assert sync == {"host_syncs": 1, "drains": 0}
        assert seen["after all_reduce"]["host_syncs"] == 1  # the plain call waits on the device only
        assert (seen["after copy out"]["host_syncs"], seen["after copy out"]["drains"]) == (2, 1)
        assert (seen["after a second copy out"]["host_syncs"], seen["after a second copy out"]["drains"]) == (3, 1)
        assert (seen["after synchronize"]["host_syncs"], seen["after synchronize"]["drains"]) == (4, 1)
        # sum() ran after the collective (an operator waits for its device, uncounted); item() found nothing queued
        assert (seen["after item"]["host_syncs"], seen["after item"]["drains"]) == (5, 1)
        assert seen["after a pinned non-blocking copy"]["host_syncs"] == 0
        assert seen["after a pageable non-blocking copy"]["host_syncs"] == 1


def test_a_blocking_copy_synchronises_the_current_stream_which_threads_share(completion):
    """WorkHCCL::wait blocks the current stream (master:ProcessGroupHCCL.cpp:1016-1021); a blocking copy synchronises
    the current stream only (CopyKernel.cpp:125-160); a thread that sets no stream of its own is on the device's
    default stream, which every such thread shares (torch_npu's current stream, as CUDA's)."""
    seen = completion[0]
    assert seen["another stream reads"] == [7.0]
    assert seen["another stream seconds"] < LATE / 2
    assert seen["completed after another stream's copy"] is False
    assert seen["another thread's copy on the default stream waited"] is True


def _memory(rank, world_size):
    from comm.testing import device_counters

    seen = {"before": device_counters(), "free before": torch.npu.mem_get_info()[0],
            "reserved before": torch.npu.memory_reserved()}
    group = dist.new_group([0, 1])
    seen["made"] = device_counters()  # the counters below are read for their communicator keys
    dist.all_reduce(_npu(rank, [1.0]), group=group)
    seen["first collective"] = device_counters()
    dist.all_reduce(_npu(rank, [1.0]), group=group)
    seen["second collective"] = device_counters()
    seen["free after"] = torch.npu.mem_get_info()[0]
    seen["reserved after"] = torch.npu.memory_reserved()
    peer = _npu(rank, [0.0])
    if rank == 0:
        dist.send(peer, 1, group=group)
        dist.send(peer, 1, group=group)
    else:
        dist.recv(peer, 0, group=group)
        dist.recv(peer, 0, group=group)
    seen["p2p"] = device_counters()
    dist.destroy_process_group(group)
    seen["destroyed"] = device_counters()
    return seen


def test_a_communicator_charges_hccl_buffsize_and_each_p2p_peer_twice_p2p_hccl_buffsize():
    """HCCL_BUFFSIZE (200 MB by default) at a communicator's first collective; 2 x P2P_HCCL_BUFFSIZE (20 MB) per
    point-to-point peer (torch_npu docs, environment_variable/collective_communication/; reality finding 7). HCCL
    allocates it itself: mem_get_info sees it, the caching allocator's memory_reserved does not."""
    mib = 1 << 20
    for env, buffer, p2p in (({}, 200, 40), ({"HCCL_BUFFSIZE": "64", "P2P_HCCL_BUFFSIZE": "5"}, 64, 10)):
        for seen in run_ranks(_memory, 2, backend="hccl", simulate=NPU, env=env):
            held = seen["before"]["communicator_bytes"]
            count = seen["before"]["communicators"]
            assert seen["made"]["communicators"] == count  # made lazily, at the first collective
            assert seen["first collective"]["communicators"] == count + 1
            assert seen["first collective"]["communicator_bytes"] == held + buffer * mib
            assert seen["second collective"]["communicator_bytes"] == seen["first collective"]["communicator_bytes"]
            # mem_get_info also sees the scenario's own tensors (memory_reserved: two of 4 bytes here)
            tensors = seen["reserved after"] - seen["reserved before"]
            assert 0 < tensors < mib
            assert seen["free before"] - seen["free after"] == buffer * mib + tensors
            assert seen["p2p"]["communicators"] == count + 2
            assert seen["p2p"]["communicator_bytes"] == held + (buffer + p2p) * mib
            assert seen["destroyed"]["communicators"] == count
            assert seen["destroyed"]["communicator_bytes"] == held


_ERRORS = r"""
import sys, time, torch, torch.distributed as dist
import comm.testing
comm.testing.simulate_accelerator("npu", "hccl", device_count=1)
dist.init_process_group("hccl", rank=0, world_size=1, store=dist.HashStore(), device_id=torch.device("npu:0"))
tensor = torch.ones(2, device="npu:0")
comm.testing.fail_next("fail_async")
work = dist.all_reduce(tensor, async_op=True)
try:
    work.wait()
    print("wait returned", flush=True)
except RuntimeError as error:
    print("wait raised", str(error).splitlines()[0], flush=True)
    sys.exit(0)
while not work.is_completed():
    time.sleep(0.01)
time.sleep(1)  # the watchdog's time to act
try:
    reported = str(work.exception()).splitlines()[0]
except TypeError:  # torch 2.9's Work.exception binding cannot convert the exception it returns
    reported = "(no Work.exception binding)"
print("survived", work.is_success(), tensor.cpu().tolist(), reported, flush=True)
"""


def _run_errors(env):
    import os
    import subprocess
    import sys

    environment = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", _ERRORS], env=environment, capture_output=True, text=True,
                          timeout=300)


def test_a_failed_collective_tears_the_process_down_by_default():
    """HCCL's default error model: wait() raises nothing; the watchdog sees the failure and TearDown rethrows it on
    its thread, ending the process (master:ProcessGroupHCCL.cpp:987-1002, 1016-1113; HCCL_ASYNC_ERROR_HANDLING)."""
    done = _run_errors({})
    assert "wait returned" in done.stdout
    assert "survived" not in done.stdout
    assert done.returncode != 0
    assert "taking the entire process down" in done.stderr
    assert "injected backend failure (on wait)" in done.stderr


def test_without_async_error_handling_a_failed_collective_is_reported_only_by_the_work():
    """HCCL_ASYNC_ERROR_HANDLING=0: nothing tears down; isSuccess()/exception() report it; the outputs are garbage."""
    done = _run_errors({"HCCL_ASYNC_ERROR_HANDLING": "0"})
    assert done.returncode == 0, done.stderr
    assert "wait returned" in done.stdout
    assert "survived False [nan, nan]" in done.stdout
    reported = done.stdout.split("survived False [nan, nan] ", 1)[1].strip()
    assert reported in ("injected backend failure (on wait)", "(no Work.exception binding)")


def test_blocking_wait_raises_the_failure_from_wait():
    """TORCH_HCCL_BLOCKING_WAIT=1: WorkHCCL::wait blocks the host and raises (master:ProcessGroupHCCL.cpp:1016-1113);
    the watchdog stands down."""
    done = _run_errors({"TORCH_HCCL_BLOCKING_WAIT": "1"})
    assert done.returncode == 0, done.stderr
    assert "wait raised injected backend failure (on wait)" in done.stdout
