"""comm.testing: the simulated accelerator behaves like the real one, errors included."""

import threading

import pytest
import torch
import torch.distributed as dist

import comm
import comm.testing

from multiproc import NPU, SEED_ERROR, in_one_rank, run_ranks


def _tensors_and_collectives(rank, world_size):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    data = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    on_npu = data.to(f"npu:{rank}")
    seen = {
        "device": str(on_npu.device),
        "roundtrip": torch.equal(on_npu.cpu(), data),
        "cpu_type": type(on_npu.to("cpu")) is torch.Tensor,
        "arithmetic": torch.equal((on_npu * 2 + 1).sum(0).cpu(), (data * 2 + 1).sum(0)),
        "view_writes_through": None,
        "accelerator": str(torch.accelerator.current_accelerator()),
        "default_for_npu": dist.get_default_backend_for_device("npu"),
        "repr": repr(torch.ones(1, device="npu")),
    }
    column = on_npu[:, 1]
    column.add_(100)
    seen["view_writes_through"] = torch.equal(on_npu.cpu()[:, 1], data[:, 1] + 100)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        on_npu + data
    seen["cpu_scalar_mixes"] = torch.equal((on_npu * torch.tensor(2.0)).cpu(), on_npu.cpu() * 2)

    seen.update(_storage_and_dtypes(rank))
    comm.testing.reset_counters()
    total = torch.full((4,), float(rank + 1), device="npu")
    dist.all_reduce(total)
    seen["all_reduce"] = total.cpu()
    with pytest.raises(RuntimeError) as failure:
        dist.all_reduce(torch.ones(4))
    seen["seed_error"] = str(failure.value)
    mesh = init_device_mesh("npu", (world_size,))
    seen["mesh_device"] = mesh.device_type
    seen["functional"] = funcol.all_reduce(torch.ones(2, device="npu"), "sum", mesh).cpu()
    seen["counters"] = comm.testing.counters()  # 2 collectives; copies back: all_reduce, functional
    return seen


def _storage_and_dtypes(rank):
    """What FSDP2 and ordinary code do with device tensors: storages, views, dtypes."""
    seen = {}
    block = torch.ones(4, device="npu")
    storage = block.untyped_storage()
    storage.resize_(0)  # FSDP2 frees an unsharded parameter so ...
    seen["freed"] = storage.size()
    storage.resize_(16)  # ... and refills it before the next all-gather
    block.fill_(2.0)
    block.resize_(8)
    block[4:].fill_(3.0)
    seen["resized"] = (block.untyped_storage().size(), block.cpu().tolist())
    shared = torch.empty(0, device="npu").set_(block.untyped_storage(), 2, (3,))
    shared.add_(10)  # writes through to block
    seen["set_"] = (str(shared.device), block.cpu().tolist())
    param = torch.nn.Parameter(torch.zeros(2))
    param.data = torch.ones(2, device="npu")  # FSDP2 moving a parameter
    seen["set_data"] = (str(param.device), param.cpu().tolist())
    seen["pinned"] = (torch.ones(3).pin_memory().is_pinned(), torch.ones(3).is_pinned())
    values = torch.arange(6)
    for dtype in (torch.bool, torch.bfloat16, torch.int64):
        on_npu = values.to(dtype).to("npu")
        seen[str(dtype)] = (on_npu.dtype == dtype, torch.equal((on_npu * 2).cpu(), values.to(dtype) * 2))
    seen["0-dim"] = (torch.tensor(3.0, device="npu").dim(), torch.tensor(3.0, device="npu").item())
    matrix = torch.arange(6.0).reshape(2, 3)
    transposed = matrix.to("npu").t()
    seen["strided"] = (transposed.is_contiguous(), torch.equal(transposed.contiguous().cpu(), matrix.t()))
    in_thread = []  # the current device is per thread, as on hardware: a new thread starts on device 0
    thread = threading.Thread(target=lambda: in_thread.append(torch.npu.current_device()))
    thread.start()
    thread.join()
    seen["thread_device"] = (torch.npu.current_device(), in_thread[0])
    other = torch.ones(2, device=f"npu:{1 - rank}")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        other + torch.ones(2, device="npu")
    return seen


def test_simulated_npu_behaves_like_a_device():
    for rank, seen in enumerate(run_ranks(_tensors_and_collectives, 2, backend="hccl", simulate=NPU)):
        assert seen["device"] == f"npu:{rank}"
        assert seen["roundtrip"] and seen["cpu_type"] and seen["arithmetic"]
        assert seen["view_writes_through"] and seen["cpu_scalar_mixes"]
        assert seen["accelerator"] == "npu"
        assert seen["default_for_npu"] == "hccl"
        assert seen["repr"] == f"tensor([1.], device='npu:{rank}')"
        assert torch.equal(seen["all_reduce"], torch.full((4,), 3.0))
        assert seen["seed_error"] == SEED_ERROR  # the first seed's exact error, on CPU
        assert seen["mesh_device"] == "npu"
        assert torch.equal(seen["functional"], torch.full((2,), 2.0))
        assert seen["counters"] == {"transfers": 2, "collectives": 2}
        assert seen["freed"] == 0
        assert seen["resized"] == (32, [2.0] * 4 + [3.0] * 4)
        assert seen["set_"] == (f"npu:{rank}", [2.0, 2.0, 12.0, 12.0, 13.0, 3.0, 3.0, 3.0])
        assert seen["set_data"] == (f"npu:{rank}", [1.0, 1.0])
        assert seen["pinned"] == (True, False)
        assert seen["torch.bool"] == seen["torch.bfloat16"] == seen["torch.int64"] == (True, True)
        assert seen["0-dim"] == (0, 3.0)
        assert seen["strided"] == (False, True)
        assert seen["thread_device"] == (rank, 0)


def _setup_rules():
    comm.testing.simulate_accelerator(**NPU)  # same arguments again: nothing to do
    with pytest.raises(RuntimeError, match="already set up"):
        comm.testing.simulate_accelerator("npu", "hccl", device_count=2)
    return comm.testing.simulated_accelerator()


def test_setup_is_idempotent_and_exclusive():
    assert in_one_rank(_setup_rules) == "npu"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "cuda"}, "name must not be a built-in device type"),
        ({"name": "NPU"}, "name must be a lower-case identifier"),
        ({"backend": "gloo"}, "backend 'gloo' is already registered"),
        ({"device_count": 0}, "device_count must be a positive int"),
        ({"name": "foo", "backend": "foob", "torch_npu_patches": True}, "True only for 'npu'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        comm.testing.simulate_accelerator(**kwargs)
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


def test_torch_npu_patches_need_the_simulated_npu():
    with pytest.raises(RuntimeError, match="needs the simulated NPU"):
        comm.testing.apply_torch_npu_patches()


def _torch_npus_patches_work(rank, world_size):
    """After comm.patch(), as at a late ``import torch_npu``: torch_npu's objects in place, none of them comm's."""
    import io

    import torch.distributed as dist

    comm.patch()
    comm.testing.apply_torch_npu_patches()
    comm.testing.apply_torch_npu_patches()  # once per process: nothing more
    c10d = dist.distributed_c10d
    placed = [dist.gather, c10d.gather, dist.gather_object, dist.batch_isend_irecv, torch.nn.Module.to, torch.load]
    seen = {"not comm's": not any(hasattr(obj, "__wrapped__") for obj in placed),
            "aliased": dist.gather is c10d.gather and dist.batch_isend_irecv is c10d.batch_isend_irecv}
    gathered = [torch.zeros(2) for _ in range(world_size)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0)  # CPU tensors on the hccl group: staged
    seen["gather"] = None if gathered is None else [t.tolist() for t in gathered]
    objects = [None] * world_size if rank == 0 else None
    dist.gather_object(rank * 10, objects, dst=0)
    seen["gather_object"] = objects
    received = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank + 1)), 1 - rank),
           dist.P2POp(dist.irecv, received, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):  # CPU: one op at a time, as torch_npu issues them
        work.wait()
    seen["batch"] = received.tolist()
    seen["module.to"] = str(next(torch.nn.Linear(2, 2).to(f"npu:{rank}").parameters()).device)
    buffer = io.BytesIO()
    torch.save(torch.ones(2), buffer)
    buffer.seek(0)
    seen["load"] = torch.load(buffer).tolist()
    comm.unpatch()
    return seen


def test_torch_npus_patches_replace_torchs_objects_with_their_own():
    for rank, seen in enumerate(run_ranks(_torch_npus_patches_work, 2, backend="hccl", simulate=NPU)):
        assert seen["not comm's"] and seen["aliased"]
        assert seen["gather"] == ([[0.0, 0.0], [1.0, 1.0]] if rank == 0 else None)
        assert seen["gather_object"] == ([0, 10] if rank == 0 else None)
        assert seen["batch"] == [2.0 - rank] * 2
        assert seen["module.to"] == f"npu:{rank}" and seen["load"] == [1.0, 1.0]


def test_without_a_compiler_it_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no build cached here
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert not comm.testing.can_simulate()
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler .*'no-such-compiler' is not on PATH"):
        comm.testing.simulate_accelerator()
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


def _plugin_owns_privateuse1(rank, world_size):
    torch.utils.rename_privateuse1_backend("foo")  # what a real plugin does at import
    with pytest.raises(RuntimeError, match="PrivateUse1 already belongs to 'foo'"):
        comm.testing.simulate_accelerator()
    return True


def test_refuses_when_a_real_plugin_owns_privateuse1():
    assert run_ranks(_plugin_owns_privateuse1, 1, backend=None) == [True]


def _dtensor_on_npu(rank, world_size):
    """DTensor redistributions of NPU-resident shards, and CPU tensors through every path."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from multiproc import file_store

    device = torch.device("npu", rank)
    dist.init_process_group("hccl", store=file_store(world_size), rank=rank, world_size=world_size, device_id=device)
    mesh = init_device_mesh("npu", (world_size,))
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sharded = distribute_tensor(full.to("npu"), mesh, [Shard(0)])
    partial = DTensor.from_local(full.to("npu") * (rank + 1), mesh, [Partial()])
    seen = {
        "bound": str(dist.group.WORLD.bound_device_id),
        "local": str(sharded.to_local().device),
        "full_tensor": sharded.full_tensor().cpu(),  # all-gather
        "shard_to_replicate": sharded.redistribute(mesh, [Replicate()]).to_local().cpu(),
        "shard_to_shard": sharded.redistribute(mesh, [Shard(1)]).to_local().cpu(),  # all-to-all
        "partial_to_replicate": partial.redistribute(mesh, [Replicate()]).to_local().cpu(),  # all-reduce
        "partial_to_shard": partial.redistribute(mesh, [Shard(0)]).to_local().cpu(),  # reduce-scatter
    }
    cpu = torch.ones(4)
    paths = {
        "c10d all_reduce": lambda: dist.all_reduce(cpu),
        "c10d all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(8), cpu),
        "c10d reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.zeros(2), cpu),
        "c10d all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(4), cpu),
        "c10d broadcast": lambda: dist.broadcast(cpu, 0),
        "functional all_reduce": lambda: funcol.all_reduce(cpu, "sum", mesh).wait(),
        "functional all_gather": lambda: funcol.all_gather_tensor(cpu, 0, mesh).wait(),
        "functional reduce_scatter": lambda: funcol.reduce_scatter_tensor(cpu, "sum", 0, mesh).wait(),
        "functional all_to_all": lambda: funcol.all_to_all_single(cpu, None, None, mesh).wait(),
        "functional broadcast": lambda: funcol.broadcast(cpu, 0, mesh).wait(),
    }
    seen["cpu"] = {}
    for name, call in paths.items():
        with pytest.raises(RuntimeError) as failure:
            call()
        seen["cpu"][name] = str(failure.value)
    both = dist.new_group(backend="cpu:gloo,npu:hccl")  # a composite backend serves both devices
    on_cpu, on_npu = torch.ones(2), torch.ones(2, device="npu")
    dist.all_reduce(on_cpu, group=both)
    dist.all_reduce(on_npu, group=both)
    seen["composite"] = (on_cpu.tolist(), on_npu.cpu().tolist(), sorted(d.type for d in both._device_types))
    return seen


def test_dtensor_redistributes_npu_shards_and_cpu_tensors_fail_everywhere():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for rank, seen in enumerate(run_ranks(_dtensor_on_npu, 2, backend=None, simulate=NPU)):
        assert seen["bound"] == seen["local"] == f"npu:{rank}"
        assert torch.equal(seen["full_tensor"], full)
        assert torch.equal(seen["shard_to_replicate"], full)
        assert torch.equal(seen["shard_to_shard"], full.chunk(2, dim=1)[rank])
        assert torch.equal(seen["partial_to_replicate"], full * 3)
        assert torch.equal(seen["partial_to_shard"], (full * 3).chunk(2)[rank])
        assert seen["cpu"] == dict.fromkeys(seen["cpu"], SEED_ERROR) and len(seen["cpu"]) == 10
        assert seen["composite"] == ([2.0, 2.0], [2.0, 2.0], ["cpu", "npu"])


def _conjugate_and_negative_views():
    values = torch.tensor([1 + 2j, 3 - 4j])
    on_npu = values.to("npu")
    torch.empty(0).pin_memory()  # no memory to pin: it must not mark every empty tensor pinned
    return {
        "conj": torch.equal(on_npu.conj().cpu(), values.conj()),
        "conj arithmetic": torch.equal((on_npu.conj() + 0).cpu(), values.conj()),
        "conj copy": torch.equal(torch.zeros(2, dtype=values.dtype, device="npu").copy_(on_npu.conj()).cpu(),
                                 values.conj()),
        "neg view": torch.equal(torch._neg_view(on_npu.real).cpu(), -values.real),
        "other empty tensors unpinned": not torch.empty(0).is_pinned(),
    }


def test_conjugate_and_negative_views_and_empty_pinned_memory():
    seen = in_one_rank(_conjugate_and_negative_views)
    assert all(seen.values()), seen


def _cached_memory():
    """Device and pinned blocks freed and asked for again, as a training step's buffers are."""
    seen = {}
    torch.npu.empty_cache()
    block = torch.empty(1000, device="npu")  # 4,000 bytes: a block of 4,096
    address, seen["reserved"] = block.data_ptr(), torch.npu.memory_reserved()
    del block
    again = torch.empty(1024, device="npu")  # the same rounded size
    seen["device block reused"] = again.data_ptr() == address
    seen["reserved after reuse"] = torch.npu.memory_reserved()
    other = torch.empty(4096, device="npu")  # another size: a fresh block of 16,384
    seen["reserved with another size"] = torch.npu.memory_reserved()
    del again, other
    torch.npu.empty_cache()
    seen["reserved after empty_cache"] = torch.npu.memory_reserved()
    pinned = torch.empty(3000, dtype=torch.uint8).pin_memory()  # 3,000 bytes: a block of 4,096
    address = pinned.data_ptr()
    del pinned
    again = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    seen["pinned block reused"] = (again.data_ptr() == address, again.is_pinned())
    # A pageable copy goes through the runtime's page-locked buffer: it takes none of the caller's.
    host = torch.arange(4096, dtype=torch.uint8)
    seen["pageable copy"] = torch.equal(host.to("npu").cpu(), host) and again.data_ptr() == address
    return seen


def test_device_and_pinned_memory_are_cached_as_torch_npus_allocators_cache_them():
    """A freed block serves the next request of its rounded size (512 bytes on the device, a power of two pinned),
    memory_reserved counts only fresh blocks, and empty_cache gives the device's back."""
    seen = in_one_rank(_cached_memory)
    assert seen == {"reserved": 4096, "device block reused": True, "reserved after reuse": 4096,
                    "reserved with another size": 4096 + 16384, "reserved after empty_cache": 0,
                    "pinned block reused": (True, True), "pageable copy": True}


def _what_frameworks_read(rank, world_size):
    """torch_npu's and torch.npu's attributes that DeepSpeed, Accelerate, Lightning and transformers read."""
    import os
    import warnings

    import torch_npu

    seen = {}
    made = torch.npu.FloatTensor([1.0, 2.0])
    seen["tensor types"] = (str(made.device), made.dtype, isinstance(made, torch.npu.FloatTensor),
                            isinstance(made, torch.npu.HalfTensor), isinstance(torch.ones(1), torch.npu.FloatTensor),
                            torch.npu.BFloat16Tensor(2, 3).dtype, str(torch.npu.LongTensor(3).device))
    keep = torch.ones(256, device="npu")
    stats = torch.npu.memory_stats()
    seen["memory_stats"] = (stats["allocated_bytes.all.current"] >= keep.numel() * 4, stats["num_ooms"],
                            stats["reserved_bytes.all.peak"] == torch.npu.memory_reserved())
    states = torch.npu.get_rng_state_all()
    seen["rng"] = ([(state.dtype, state.numel()) for state in states], len(torch.npu.default_generators))
    torch.manual_seed(7)  # seeds every device's generator too, as torch.manual_seed does on CUDA and NPU
    seen["seeded"] = (torch.npu.initial_seed(), torch.npu.get_rng_state().view(torch.int64).tolist())
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        seen["capability"] = [torch.npu.get_device_capability()]
        os.environ["TORCH_NPU_DEVICE_CAPABILITY"] = "8.0"
        seen["capability"].append(torch.npu.get_device_capability(0))
        del os.environ["TORCH_NPU_DEVICE_CAPABILITY"]
    seen["capability warned"] = len(warned)
    scaler = torch.npu.amp.GradScaler()
    parameter = torch.nn.Parameter(torch.ones(2, device="npu"))
    scaler.scale(parameter.sum()).backward()
    seen["GradScaler"] = (scaler.is_enabled(), isinstance(scaler, torch.amp.GradScaler), parameter.grad.cpu().tolist())
    seen["files"] = (os.path.isfile(torch_npu.__file__), os.path.isdir(os.environ.get("ASCEND_HOME_PATH", "/nowhere")))
    stream = torch.npu.Stream()
    keep.record_stream(stream)  # FSDP and DDP do this with their buffers
    seen["classes"] = (isinstance(stream, torch.npu.Stream), isinstance(torch.npu.Event(), torch.npu.Event),
                       torch.npu.Stream | None is not None)
    seen["attention"] = _fusion_attention_against_sdpa(torch_npu.npu_fusion_attention)
    seen["rotary"] = _rotary_mul_against_complex_rotation(torch_npu.npu_rotary_mul)
    seen["set_compile_mode"] = torch.npu.set_compile_mode(jit_compile=False)  # LLaMA-Factory's parser calls it
    from torch_npu.npu import mstx  # verl imports it at import

    ranged = mstx.mstx_range("step")(lambda value: value + 1)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        unnamed = mstx.range_start("")
    seen["mstx"] = (mstx.mark("here"), mstx.range_start("load") > 0, unnamed, len(warned), ranged(1))
    return seen


def _rotary_mul_against_complex_rotation(rotary_mul):
    """The largest difference per mode from rotating each pair of features as a complex number by its angle."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, device="npu")
    angle = torch.randn(1, 1, 5, 4, device="npu")
    found = {}
    pairs = {"half": lambda t: (t[..., :4], t[..., 4:]), "interleave": lambda t: (t[..., ::2], t[..., 1::2])}
    for mode, pair in pairs.items():
        real, imaginary = pair(x)
        rotated = torch.complex(real, imaginary) * torch.polar(torch.ones_like(angle), angle)
        halves = (angle.cos(), angle.sin())
        if mode == "half":
            r1, r2 = (torch.cat((h, h), dim=-1) for h in halves)
            expected = torch.cat((rotated.real, rotated.imag), dim=-1)
        else:
            r1, r2 = (h.repeat_interleave(2, dim=-1) for h in halves)
            expected = torch.stack((rotated.real, rotated.imag), dim=-1).flatten(-2)
        found[mode] = (rotary_mul(x, r1, r2, rotary_mode=mode) - expected).abs().max().item()
    return found


def _fusion_attention_against_sdpa(fused):
    """The largest difference from SDPA per (layout, mask) case, as transformers calls it on Ascend."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 4, device="npu") for _ in range(3))  # BSND: batch 2, 5 tokens, 3 heads
    sdpa = torch.nn.functional.scaled_dot_product_attention
    by_bnsd = [t.transpose(1, 2) for t in (q, k, v)]
    causal = sdpa(*by_bnsd, is_causal=True).transpose(1, 2)
    full = sdpa(*by_bnsd).transpose(1, 2)
    triangle = torch.ones(5, 5, dtype=torch.bool, device="npu").triu(1)  # True: masked out, as torch_npu takes it
    found = {
        "BSND causal": fused(q, k, v, 3, "BSND", atten_mask=triangle, scale=0.5, sparse_mode=2)[0] - causal,
        "BSND mask": fused(q, k, v, 3, "BSND", atten_mask=triangle, scale=0.5)[0] - causal,
        "BSH": fused(*(t.flatten(2) for t in (q, k, v)), 3, "BSH", scale=0.5)[0] - full.flatten(2),
        "BNSD": fused(*by_bnsd, 3, "BNSD", scale=0.5)[0] - full.transpose(1, 2),
    }
    return {case: float(difference.abs().max().cpu()) for case, difference in found.items()}


def test_what_frameworks_read_from_torch_npu_before_any_collective():
    [seen] = run_ranks(_what_frameworks_read, 1, backend=None, simulate=NPU)
    assert seen["tensor types"] == ("npu:0", torch.float32, True, False, False, torch.bfloat16, "npu:0")
    assert seen["memory_stats"] == (True, 0, True)
    assert seen["rng"] == ([(torch.uint8, 16)] * 8, 8)  # (seed, offset) per device, as CUDA's and NPU's
    assert seen["seeded"] == (7, [7, 0])
    assert seen["capability"] == [None, (8, 0)] and seen["capability warned"] == 2  # torch_npu's answers
    assert seen["GradScaler"] == (True, True, [65536.0, 65536.0])
    assert seen["files"] == (True, True)
    assert seen["classes"] == (True, True, True)
    assert all(difference < 1e-5 for difference in seen["attention"].values()), seen["attention"]
    assert set(seen["rotary"]) == {"half", "interleave"} and max(seen["rotary"].values()) < 1e-5, seen["rotary"]
    assert seen["set_compile_mode"] is None
    assert seen["mstx"] == (None, True, 0, 1, 2)  # torch_npu's answers: an id, 0 and a warning for no message


def _dtensor_random(rank, world_size):
    """DTensor's random tracker on the simulated NPU: it reads and advances a (seed, offset) state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, rand

    from multiproc import file_store

    dist.init_process_group("hccl", store=file_store(world_size), rank=rank, world_size=world_size,
                            device_id=torch.device("npu", rank))
    mesh = init_device_mesh("npu", (world_size,))
    draws = {}
    for name, seed in (("first", 5), ("again", 5), ("other seed", 6)):
        torch.manual_seed(seed)
        sharded = rand((4, 3), device_mesh=mesh, placements=[Shard(0)])
        replicated = rand((4, 3), device_mesh=mesh, placements=[Replicate()])
        draws[name] = (sharded.full_tensor().cpu(), replicated.to_local().cpu())
    offset = torch.npu.get_rng_state().view(torch.int64).tolist()
    dist.destroy_process_group()
    return draws, offset


def test_dtensor_random_ops_on_the_simulated_npu():
    results = run_ranks(_dtensor_random, 2, backend=None, simulate=NPU)
    (draws, offset), (other_draws, other_offset) = results
    sharded, replicated = draws["first"]
    assert torch.equal(sharded, other_draws["first"][0])  # every rank sees the same full tensor ...
    assert not torch.equal(sharded[:2], sharded[2:])  # ... whose shards drew different numbers
    assert torch.equal(replicated, other_draws["first"][1])  # a replicated draw is the same on every rank
    assert torch.equal(sharded, draws["again"][0]) and not torch.equal(sharded, draws["other seed"][0])
    assert offset == other_offset and offset[0] == 6 and offset[1] > 0  # the offset advanced past the draws


def _torch_npu_distributed_config_and_formats(rank, world_size):
    """What Ascend's own distributed tests and frameworks import from torch_npu, each used as they use it."""
    import torch_npu

    seen = {}
    value = torch.full((3,), float(rank + 1), device=f"npu:{rank}")
    dist.all_reduce(value, op=torch_npu.distributed._make_hccl_premul_sum(2.0))  # test_dist_all_reduce_pre_mul
    seen["premul"] = value.cpu().tolist()
    seen["hccl available"] = torch_npu.distributed.is_hccl_available()
    torch_npu.npu.config.allow_internal_format = False
    torch.npu.matmul.allow_hf32 = True
    seen["switches"] = (torch_npu.npu.config.allow_internal_format, torch.npu.matmul.allow_hf32,
                        torch.npu.conv.allow_hf32)
    with pytest.raises(TypeError, match="allow_hf32 must be a bool"):
        torch.npu.conv.allow_hf32 = 1
    image = torch.arange(24, dtype=torch.float32, device=f"npu:{rank}").reshape(1, 2, 3, 4)
    cast = torch_npu.npu_format_cast(image, torch_npu.Format.NC1HWC0)
    seen["formats"] = (str(torch_npu.get_npu_format(image)), str(torch_npu.get_npu_format(cast)),
                       int(torch_npu.get_npu_format(image.flatten())), torch.equal(cast.cpu(), image.cpu()),
                       torch_npu.npu_format_cast(cast, 3) is cast)
    torch_npu.npu_format_cast_(image, 2)
    seen["in place"] = str(torch_npu.get_npu_format(image))
    return seen


def test_torch_npus_distributed_config_and_formats():
    for seen in run_ranks(_torch_npu_distributed_config_and_formats, 2, backend="hccl", simulate=NPU):
        assert seen["premul"] == [6.0] * 3 and seen["hccl available"]  # 2 x (1 + 2)
        assert seen["switches"] == (False, True, False)
        assert seen["formats"] == ("NCHW", "NC1HWC0", 2, True, True) and seen["in place"] == "ND"
