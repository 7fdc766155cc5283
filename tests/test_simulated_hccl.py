"""The simulated hccl follows torch_npu's ProcessGroupHCCL, one test per rule.

Each rule cites what it mirrors in torch_npu 2.13 / 2.9.1 (Ascend/pytorch master and
v2.9.0-26.0.0, ``torch_npu/csrc/distributed/``; the findings are in
``../shared/reference/torch-npu-reality.md``). The calls run on NPU tensors on two
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
    seen["integer avg"] = error_of(_all_reduce, rank, torch.int64, ReduceOp.AVG)
    premul = dist._make_nccl_premul_sum(0.5)
    seen["premul_sum"] = _all_reduce(rank, torch.float32, premul).tolist()
    seen["premul_sum reduce_scatter"] = _reduce_scatter(rank, torch.float32, premul).tolist()
    seen["premul_sum int"] = error_of(_all_reduce, rank, torch.int32, premul)
    return seen


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


def test_avg_is_sum_then_a_divide_and_integers_are_refused(rules):
    """getHcclReduceOp maps AVG to SUM (master:ProcessGroupHCCL.cpp:136-141); the outputs are divided after
    (:4808-4816, 6272-6280); an integer's div_ raises torch's error off Ascend950."""
    for seen in rules:
        assert seen["avg"] == [1.5, 2.0]
        assert seen["avg reduce_scatter"] == [[1.5], [2.5]][rules.index(seen)]
        assert "result type Float can't be cast to the desired output type Long" in seen["integer avg"]


def test_premul_sum_scales_then_sums(rules):
    """PREMUL_SUM: SUM of inputs scaled by double_factor (master:ProcessGroupHCCL.cpp:143-150, 4797-4806)."""
    for seen in rules:
        assert seen["premul_sum"] == [1.5, 2.0]
        assert seen["premul_sum reduce_scatter"] == [[1.5], [2.5]][rules.index(seen)]
        assert "PreMulSum Data type must be half, float, bfloat16 or double" in seen["premul_sum int"]


def test_lenient_runs_what_gloo_runs():
    """lenient=True: the old simulation, every call as gloo runs it (for code written against it)."""
    for seen in run_ranks(_lenient, 2, backend="hccl", simulate=dict(NPU, lenient=True)):
        assert seen["float64"] == [3.0, 4.0] and seen["band"] == [0, 1]
        assert "PREMUL_SUM" in seen["premul_sum"]
