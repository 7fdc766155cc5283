"""comm.norm: gradient norms of sharded models equal the unsharded model's, on any device."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp
import torch.nn as nn

if not hasattr(fsdp, "fully_shard"):
    pytest.skip("needs FSDP2: torch.distributed.fsdp.fully_shard (torch >= 2.6)", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

import comm
import comm.groups
import comm.testing
from comm._releases import TORCH_VERSION

from multiproc import NPU, SEED_ERROR, error_of, file_store, run_ranks

NORM_TYPES = [1.0, 2.0, 3.5, math.inf, 0.0]
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5}
# torch's own FSDP2 and DTensor, which two tests run as the reference, cannot run on gloo
# before torch 2.8: they reduce with AVG, which gloo lacks (comm's table), and torch
# 2.6's FSDP2 on the CPU calls Stream.record_event, which CPU streams lack.
TORCH_REFERENCE_ON_GLOO = pytest.mark.skipif(
    TORCH_VERSION < comm.groups.NATIVE_AVG_SINCE["gloo"]["all_reduce"],
    reason="torch's FSDP2 and DTensor reduce with AVG, which gloo lacks before torch 2.8",
)


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _batch(dtype):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(dtype)


def _close(a, b, dtype):
    return torch.allclose(a, b, rtol=TOLERANCE[dtype], atol=0)


def _fsdp2_on_gloo(rank, world_size):
    """Real fully_shard on CPU; the reference is the same model unsharded, in this process."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    problems = []
    for dtype in (torch.float64, torch.float32):
        model, reference = _model(dtype), _model(dtype)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(_batch(dtype)).sum().backward()  # every rank the same batch: averaged grads = reference
        reference(_batch(dtype)).sum().backward()
        sharded = [p.grad.to_local().clone() for p in model.parameters()]
        unsharded = [p.grad.clone() for p in reference.parameters()]
        for p in NORM_TYPES:
            for max_norm in (0.5, 1e9):  # clipping, and a coefficient clamped to 1
                for grad, saved in zip(model.parameters(), sharded):
                    grad.grad.to_local().copy_(saved)
                for grad, saved in zip(reference.parameters(), unsharded):
                    grad.grad.copy_(saved)
                norm = comm.clip_grad_norm_(model.parameters(), max_norm, norm_type=p)
                expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=p)
                case = f"{dtype} p={p} max_norm={max_norm}"
                if norm.dtype != dtype or norm.device.type != "cpu" or not _close(norm, expected, dtype):
                    problems.append(f"{case}: norm {norm} vs {expected}")
                for ours, theirs in zip(model.parameters(), reference.parameters()):
                    if not _close(ours.grad.full_tensor(), theirs.grad, dtype):
                        problems.append(f"{case}: clipped gradients differ")
                        break
    return problems


@TORCH_REFERENCE_ON_GLOO
def test_fsdp2_on_gloo_matches_the_unsharded_model():
    assert run_ranks(_fsdp2_on_gloo, 2, timeout=300) == [[], []]


def _nonfinite(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(8.0).reshape(4, 2)
    full[3, 1] = math.inf  # on rank 1's shard only
    grad = distribute_tensor(full, mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="The total norm of order 2.0 for gradients from `parameters` is non-finite"):
        comm.total_norm([grad], error_if_nonfinite=True)  # every rank raises, not only rank 1
    seen = {"inf": comm.total_norm([grad]).item(), "torch_inf": torch.nn.utils.get_total_norm([full]).item()}
    full[0, 0] = math.nan
    grad = distribute_tensor(full, mesh, [Shard(0)])
    seen["nan"] = comm.total_norm([grad]).item()
    seen["torch_nan"] = torch.nn.utils.get_total_norm([full]).item()
    return seen


def test_nonfinite_gradients_raise_on_every_rank():
    for seen in run_ranks(_nonfinite, 2):
        assert seen["inf"] == seen["torch_inf"] == math.inf
        assert math.isnan(seen["nan"]) and math.isnan(seen["torch_nan"])


def _full_gradients(count, dtype=torch.float64):
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(4, 6, generator=generator, dtype=dtype) for _ in range(count)]


def _dp_tp_mesh(rank, world_size):
    """DP 2 x TP 2: gradients sharded on both dims, on one, replicated, and Partial.

    Built as FSDP + tensor parallel leave them, with DTensor placements directly.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh.get_local_rank("tp")
    placements = [
        [Shard(0), Shard(1)],
        [Replicate(), Shard(0)],
        [Replicate(), Replicate()],
        [Shard(0), Replicate()],
    ]
    full = _full_gradients(2 * len(placements) + 4)
    grads = [distribute_tensor(f, mesh, placements[i // 2]) for i, f in enumerate(full[:8])]
    # Partial over tp: the two tp ranks hold pieces that add up (sum) or average to the gradient.
    share = 0.25 if tp_rank == 0 else 0.75
    grads += [DTensor.from_local(f * share, mesh, [Replicate(), Partial()], run_check=False) for f in full[8:10]]
    grads += [DTensor.from_local(f.clone(), mesh, [Replicate(), Partial("avg")], run_check=False) for f in full[10:]]
    problems = []
    for p in NORM_TYPES:
        with comm.profile() as profile:
            norm = comm.total_norm(grads, norm_type=p)
        expected = torch.nn.utils.get_total_norm(full, norm_type=p)
        if not _close(norm, expected, torch.float64):
            problems.append(f"p={p}: {norm.item()} vs {expected.item()}")
        calls = _collectives(profile)
        # One collective per bucket and reduced dim: (dp, tp) 2, (tp) 1, (dp) 1; one per Partial op.
        if calls != {"all_reduce": 4, "all_reduce_coalesced": 2}:
            problems.append(f"p={p}: collectives {calls}")
    params = [distribute_tensor(torch.zeros_like(f), mesh, g.placements if not any(
        pl.is_partial() for pl in g.placements) else [Replicate(), Replicate()]) for f, g in zip(full, grads)]
    for param, grad in zip(params, grads):
        param.grad = grad
    reference = [f.clone().requires_grad_() for f in full]
    for ref, f in zip(reference, full):
        ref.grad = f.clone()
    norm = comm.clip_grad_norm_(params, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    if not _close(norm, expected, torch.float64):
        problems.append(f"clip norm {norm.item()} vs {expected.item()}")
    for i, (param, ref) in enumerate(zip(params, reference)):
        if not _close(param.grad.full_tensor(), ref.grad, torch.float64):
            problems.append(f"clipped gradient {i} ({param.grad.placements}) differs")
    return problems


def _collectives(profile):
    """The collectives a profiled block issued, by name: what comm.profile() timed."""
    return {name: figures["calls"] for name, figures in profile.to_dict().items() if figures["calls"]}


@TORCH_REFERENCE_ON_GLOO
def test_2d_mesh_counts_no_gradient_twice():
    assert run_ranks(_dp_tp_mesh, 4, timeout=300) == [[]] * 4


def _expert_mesh(rank, world_size):
    """A dense 1-D mesh over 4 ranks and an expert mesh (dp 2 x ep 2): other groups in one model.

    The expert shard held by ranks 1 and 3 got no tokens: those ranks hold no
    gradient at all in the expert bucket, yet must join its collective.
    """
    dense = init_device_mesh("cpu", (world_size,))
    experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    full_dense, full_expert, full_unused = _full_gradients(3)
    dense_param = distribute_tensor(torch.zeros(4, 6, dtype=torch.float64), dense, [Shard(0)])
    dense_param.grad = distribute_tensor(full_dense, dense, [Shard(1)])
    expert_param = distribute_tensor(torch.zeros(4, 6, dtype=torch.float64), experts, [Replicate(), Shard(0)])
    ep_rank = experts.get_local_rank("ep")
    if ep_rank == 0:
        expert_param.grad = DTensor.from_local(full_expert[:2], experts, [Replicate(), Shard(0)], run_check=False)
    reference_expert = full_expert.clone()
    reference_expert[2:] = 0  # the shard of ep rank 1 has no gradient
    problems = []
    for p in NORM_TYPES:
        with comm.profile() as profile:
            norm = comm.clip_grad_norm_([dense_param, expert_param], 1e9, norm_type=p)
        expected = torch.nn.utils.get_total_norm([full_dense, reference_expert], p)
        if not _close(norm, expected, torch.float64):
            problems.append(f"p={p}: {norm.item()} vs {expected.item()}")
        if _collectives(profile) != {"all_reduce": 2}:  # the dense bucket and the expert bucket
            problems.append(f"p={p}: {_collectives(profile)} collectives")
    return problems


def test_expert_mesh_and_ranks_without_gradient():
    assert run_ranks(_expert_mesh, 4, pg_timeout=30, timeout=300) == [[]] * 4


def _second_seed(rank, world_size):
    """The second seed as users meet it: FSDP2 with CPUOffloadPolicy on an hccl mesh."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    seen = {"bind": str(comm.bind())}
    dist.init_process_group(
        "hccl", store=file_store(world_size), rank=rank, world_size=world_size, device_id=torch.device("npu", rank)
    )
    seen["bound"] = str(dist.group.WORLD.bound_device_id)
    seen["to"] = str(torch.ones(1).to("npu").device)
    mesh = init_device_mesh("npu", (world_size,))
    model, reference = _model(torch.float32), _model(torch.float32)
    for module in [*(layer for layer in model if isinstance(layer, nn.Linear)), model]:
        fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy())
    backward = set()
    output = model(_batch(torch.float32).to("npu"))
    output.register_hook(lambda grad: backward.add((str(grad.device), torch.accelerator.current_device_index())))
    output.sum().backward()  # every rank the same batch: averaged gradients = the reference's
    reference(_batch(torch.float32)).sum().backward()
    seen["forward"], seen["backward"] = str(output.device), sorted(backward)
    seen["grad_devices"] = sorted({p.grad.to_local().device.type for p in model.parameters()})
    saved = [p.grad.to_local().clone() for p in model.parameters()]
    seen["torch"] = error_of(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)
    for param, grad in zip(model.parameters(), saved):  # in case torch scaled some before failing
        param.grad.to_local().copy_(grad)
    seen["norm"] = comm.clip_grad_norm_(model.parameters(), 1.0)
    seen["expected"] = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    seen["clipped_local"] = [p.grad.to_local().clone() for p in model.parameters()]
    seen["expected_local"] = [r.grad.chunk(world_size)[rank].clone() for r in reference.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen["losses"] = []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(_batch(torch.float32).to("npu") + step).square().mean()
        loss.backward()
        comm.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seen["losses"].append(loss.item())
    return seen


def test_second_seed_reproduced_and_fixed_on_simulated_npu():
    """FSDP2 + CPUOffloadPolicy on the simulated NPU: torch's clip fails, comm's matches the unsharded norm."""
    for rank, seen in enumerate(run_ranks(_second_seed, 2, backend=None, simulate=NPU)):
        assert seen["bind"] == seen["bound"] == seen["to"] == seen["forward"] == f"npu:{rank}"
        assert seen["backward"] == [(f"npu:{rank}", rank)]  # the autograd engine ran it on this rank's device
        assert seen["grad_devices"] == ["cpu"]
        assert seen["torch"] == SEED_ERROR
        assert torch.allclose(seen["norm"], seen["expected"], rtol=1e-5)
        assert seen["norm"].device.type == "cpu"
        for ours, theirs in zip(seen["clipped_local"], seen["expected_local"]):
            assert torch.allclose(ours, theirs, rtol=1e-5)
        assert len(seen["losses"]) == 3 and all(math.isfinite(loss) for loss in seen["losses"])


def test_plain_tensors_and_bad_input():
    grads = _full_gradients(3)
    for p in NORM_TYPES:
        assert torch.allclose(comm.total_norm(grads, p), torch.nn.utils.get_total_norm(grads, p), rtol=1e-12)
    assert comm.total_norm([]).item() == 0.0
    with pytest.raises(ValueError, match="norm_type must be p > 0, 0, inf or -inf"):
        comm.total_norm(grads, -2)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor"):
        comm.total_norm([grads[0], 3.0])
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        comm.clip_grad_norm_([torch.zeros(2, requires_grad=True)], -1.0)
    param = torch.zeros(3, requires_grad=True)
    param.grad = torch.full((3,), 10.0)
    param.main_grad = torch.full((3,), 4.0)  # Megatron-style main_grad wins over .grad
    assert comm.clip_grad_norm_([param], 1.0).item() == pytest.approx(math.sqrt(48))
    assert torch.allclose(param.main_grad, torch.full((3,), 4.0 / (math.sqrt(48) + 1e-6)))
    assert torch.equal(param.grad, torch.full((3,), 10.0))


@pytest.mark.cuda
def test_fsdp2_cpu_offload_on_a_real_nccl_group(nccl_group):
    """The second seed on real hardware: FSDP2 with CPUOffloadPolicy on nccl."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda", (1,))
    model, reference = _model(torch.float32), _model(torch.float32)
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    model(_batch(torch.float32).cuda()).sum().backward()
    reference(_batch(torch.float32)).sum().backward()
    assert all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
    with pytest.raises(RuntimeError, match=SEED_ERROR):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    norm = comm.clip_grad_norm_(model.parameters(), 1e9)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    assert torch.allclose(norm, expected, rtol=1e-5)
