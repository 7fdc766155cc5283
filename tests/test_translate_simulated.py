"""comm.translate on two simulated NPUs: CUDA-only calls act on each rank's own npu device."""

import io
import os

import pytest
import torch
import torch.distributed as dist

from multiproc import NPU, free_port, in_one_rank, no_cuda_errors, run_ranks


def _cuda_calls_on_the_npu(rank, world_size):
    import importlib.util

    from test_translate import _checkpoint_saved_on_cuda

    import comm

    from multiproc import error_of

    failures = (RuntimeError, AttributeError, AssertionError, ValueError)
    seen = {"unpatched": [error_of(line, catch=failures, typed=True) for line in (
        lambda: torch.cuda.set_device(rank), lambda: torch.nn.Linear(2, 2).cuda(rank),
        lambda: dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1))]}
    comm.patch()
    torch.cuda.set_device(rank)
    seen["current"] = (torch.cuda.current_device(), torch.npu.current_device())
    seen["policy"] = (torch.cuda.is_available(), torch.cuda.device_count())
    dist.init_process_group(backend="nccl", store=dist.FileStore(os.environ["COMM_TEST_STORE"], world_size),
                            rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    seen["group"] = (dist.get_backend(), str(dist.group.WORLD.bound_device_id))
    seen["devices"] = [str(d) for d in (
        torch.ones(1, device="cuda").device, torch.ones(1).cuda().device, torch.ones(1).cuda(1).device,
        torch.ones(1).to(torch.device("cuda", 0)).device, torch.ones(1).to(rank).device,
        torch.nn.Linear(2, 2).cuda(rank).weight.device, torch.ones(1).pin_memory().device)]
    value = torch.full((2,), float(rank + 1), device="cuda")
    dist.all_reduce(value)
    on_cpu = torch.full((2,), float(rank + 1))
    dist.all_reduce(on_cpu)  # a CPU tensor on the hccl group: comm's staging
    seen["sums"] = (value.cpu().tolist(), on_cpu.tolist())
    group = dist.new_group(backend="cuda:nccl")
    seen["new_group"] = dist.get_backend(group)
    from torch.distributed.device_mesh import init_device_mesh

    seen["mesh"] = init_device_mesh("cuda", (world_size,)).device_type
    # Memory statistics and the cache release, as the seed's end of epoch does them.
    keep = torch.ones(1 << 16, device="cuda")
    spare = torch.ones(1 << 16, device="cuda")
    del spare  # cached: the release gives it back, not `keep`
    reserved = torch.cuda.memory_reserved()
    with torch.cuda.device(torch.device("cuda", rank)):
        torch.cuda.empty_cache()
    released = reserved - torch.cuda.memory_reserved()
    size = keep.numel() * 4
    seen["memory"] = (released >= size, torch.cuda.memory_reserved() >= size,
                      torch.cuda.max_memory_allocated() >= 2 * size)
    seen["load"] = str(torch.load(io.BytesIO(_checkpoint_saved_on_cuda()))["w"].device)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = (torch.nn.Linear(2, 1).cuda()(torch.ones(3, 2, device="cuda"))).sum()
    scaler.scale(loss).backward()
    seen["amp"] = (scaler.is_enabled(), scaler.get_scale())
    # The stand-in torch_npu, as Accelerate and transformers look for Ascend.
    import torch_npu

    seen["torch_npu"] = (importlib.util.find_spec("torch_npu") is not None, torch_npu.npu.is_available(),
                         torch_npu.__spec__.origin)
    comm.unpatch()
    return seen


def test_cuda_calls_act_on_each_ranks_npu():
    results = run_ranks(_cuda_calls_on_the_npu, 2, backend=None, simulate=NPU)
    for rank, seen in enumerate(results):
        errors = no_cuda_errors()
        assert seen["unpatched"] == [  # the errors, on the simulated NPU without comm
            errors["set_device"], errors["model.cuda(rank) beside an npu"], errors["nccl"]]
        assert seen["current"] == (rank, rank)
        assert seen["policy"] == (True, 8)
        assert seen["group"] == ("hccl", f"npu:{rank}")
        assert seen["devices"] == [f"npu:{rank}", f"npu:{rank}", "npu:1", "npu:0", f"npu:{rank}", f"npu:{rank}",
                                   "cpu"]
        assert seen["sums"] == ([3.0, 3.0], [3.0, 3.0])
        assert seen["new_group"] == "npu:hccl" and seen["mesh"] == "npu"
        assert seen["memory"] == (True, True, True)  # the cache release gave the cached block back, not the held one
        assert seen["load"] == f"npu:{rank}"  # a cuda:1 checkpoint lands on this rank's device
        assert seen["amp"] == (True, 65536.0)
        assert seen["torch_npu"] == (True, True, "comm.testing (simulated NPU)")


def _accelerate_job(rank, world_size):
    from accelerate import Accelerator

    import comm

    comm.patch()  # as under python -m comm: Accelerate asks torch.cuda too
    accelerator = Accelerator()
    state = accelerator.state
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    seen = (str(state.distributed_type), state.num_processes, str(accelerator.device), state.backend,
            str(next(model.parameters()).device))
    comm.unpatch()
    return seen


def test_accelerate_sees_an_npu_job_of_two_processes():
    pytest.importorskip("accelerate")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "LOCAL_WORLD_SIZE": "2"}
    results = run_ranks(_accelerate_job, 2, backend=None, simulate=NPU, env=env)
    assert results == [("DistributedType.MULTI_NPU", 2, f"npu:{rank}", "hccl", f"npu:{rank}") for rank in range(2)]


def _cuda_classes_and_capabilities_on_the_npu():
    import comm

    comm.patch()
    try:
        stream, event = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
        properties = torch.cuda.get_device_properties(0)
        return {
            "stream": (type(stream) is torch.npu.Stream, isinstance(stream, torch.cuda.Stream),
                       isinstance(torch.cuda.current_stream(), torch.cuda.Stream), str(stream.device)),
            "event": (isinstance(event, torch.npu.Event), isinstance(event, torch.cuda.Event)),
            # torchao's import-time check: torch_npu answers None, which CUDA code cannot index
            "torchao": torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10,
            "capability": torch.cuda.get_device_capability(),
            "properties": (properties.name, properties.major, properties.total_memory > 0),
            "rng": [state.numel() for state in torch.cuda.get_rng_state_all()],
            "memory_stats": "allocated_bytes.all.current" in torch.cuda.memory_stats(),
        }
    finally:
        comm.unpatch()  # the one-rank worker serves other tests next


def test_cuda_classes_and_capability_queries_on_the_npu():
    seen = in_one_rank(_cuda_classes_and_capabilities_on_the_npu)
    assert seen == {
        "stream": (True, True, True, "npu:0"),
        "event": (True, True),
        "torchao": False,
        "capability": (0, 0),
        "properties": ("simulated npu (comm.testing)", 0, True),
        "rng": [16] * 8,
        "memory_stats": True,
    }
