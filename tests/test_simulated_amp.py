"""Mixed precision and random numbers on the simulated NPU (comm/testing/csrc/autocast.cpp, random.cpp).

``torch.autocast("npu")`` casts as torch_npu registers (CUDA's lists), ``torch.Generator("npu")``
is a real generator of the device whose numbers the CPU kernels draw, the devices' default
generators hold torch_npu's (seed, offset) state, and an AMP training step (autocast,
GradScaler, FSDP2 with CPU offload, clipping) on two simulated NPUs trains as the same step
on CPU gloo does.
"""

import torch

from multiproc import NPU, in_one_rank, run_ranks

# What CUDA's autocast policy (and torch_npu's, the same lists) gives in bfloat16: matrix
# products in the lower precision, softmax, losses, norms, exp and sum in float32, and
# everything else in its inputs' dtype.
CUDA_POLICY = {"matmul": torch.bfloat16, "linear": torch.bfloat16, "addmm": torch.bfloat16,
               "bmm": torch.bfloat16, "softmax": torch.float32, "log_softmax": torch.float32,
               "mse_loss": torch.float32, "cross_entropy": torch.float32, "layer_norm": torch.float32,
               "exp": torch.float32, "sum": torch.float32, "relu": torch.bfloat16, "add": torch.bfloat16}


def _autocast_results():
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    labels = torch.tensor([0, 1, 2, 0])
    on_npu = [t.to("npu") for t in (x, w, b, labels)]
    dtypes, values = {}, {}
    with torch.autocast("npu", dtype=torch.bfloat16):
        x_, w_, b_, labels_ = on_npu
        out = F.linear(x_, w_, b_)
        made = {
            "matmul": torch.matmul(x_, w_.t()), "linear": out, "addmm": torch.addmm(b_, x_, w_.t()),
            "bmm": torch.bmm(x_[None], w_.t()[None]), "softmax": torch.softmax(out, -1),
            "log_softmax": F.log_softmax(out, -1), "mse_loss": F.mse_loss(out, torch.zeros_like(out)),
            "cross_entropy": F.cross_entropy(out, labels_), "layer_norm": F.layer_norm(out, (3,)),
            "exp": out.exp(), "sum": out.sum(), "relu": out.relu(), "add": out + out,
        }
        dtypes = {name: tensor.dtype for name, tensor in made.items()}
        values = {name: made[name].cpu() for name in ("linear", "softmax", "mse_loss")}
        try:
            F.binary_cross_entropy(torch.sigmoid(out), torch.ones_like(out))
            banned = None
        except RuntimeError as error:
            banned = str(error).splitlines()[0]
    with torch.autocast("npu"):  # torch's default autocast dtype for a plugin's device: float16
        default_dtype = torch.mm(on_npu[0], on_npu[1].t()).dtype
    with torch.autocast("npu", enabled=False):
        disabled = torch.mm(on_npu[0], on_npu[1].t()).dtype
    return dtypes, values, banned, default_dtype, disabled


def test_autocast_casts_as_torch_npu_registers():
    dtypes, values, banned, default_dtype, disabled = in_one_rank(_autocast_results)
    assert dtypes == CUDA_POLICY
    # The values are torch's, run natively on the CPU in the dtypes the policy chose.
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    linear = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    torch.testing.assert_close(values["linear"], linear, rtol=0, atol=0)
    torch.testing.assert_close(values["softmax"], torch.softmax(linear.float(), -1), rtol=0, atol=0)
    torch.testing.assert_close(values["mse_loss"], linear.float().square().mean(), rtol=0, atol=0)
    assert banned == "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast."
    assert (default_dtype, disabled) == (torch.float16, torch.float32)


def _generator_draws():
    import torch.nn.functional as F

    seen = {}
    g = torch.Generator("npu")
    x = torch.ones(64, device="npu")

    def dropout_mask(seed):  # dropout with an explicit generator: a Bernoulli mask drawn from it
        g.manual_seed(seed)
        return torch.bernoulli(torch.full_like(x, 0.5), generator=g).cpu()

    seen["generator"] = (type(g) is torch.Generator, str(g.device), str(torch.Generator("npu:1").device),
                         all(type(d) is torch.Generator for d in torch.npu.default_generators))
    seen["reseeded"] = torch.equal(dropout_mask(3), dropout_mask(3))
    seen["other seed"] = torch.equal(dropout_mask(3), dropout_mask(4))
    seen["as the CPU's"] = torch.equal(dropout_mask(3), torch.bernoulli(torch.full((64,), 0.5),
                                                                        generator=torch.Generator().manual_seed(3)))
    g.manual_seed(3)
    first, second = (torch.randn(8, device="npu", generator=g).cpu() for _ in range(2))
    seen["advances"] = (not torch.equal(first, second), g.get_offset())
    # F.dropout draws from the device's default generator, seeded by torch.npu.manual_seed.
    torch.npu.manual_seed(5)
    once = F.dropout(x, 0.5).cpu()
    torch.npu.manual_seed(5)
    seen["F.dropout reseeded"] = torch.equal(once, F.dropout(x, 0.5).cpu())
    torch.manual_seed(5)
    seen["F.dropout as the CPU's"] = torch.equal(once, F.dropout(torch.ones(64), 0.5))
    state = torch.npu.get_rng_state()
    drawn = torch.rand(8, device="npu").cpu()
    torch.npu.set_rng_state(state)
    seen["state replays"] = (torch.equal(drawn, torch.rand(8, device="npu").cpu()), state.dtype, state.numel())
    seen["checkpoint"] = _checkpointed_dropout_grads()
    try:
        torch.rand(2, device="npu", generator=torch.Generator())
        seen["cpu generator"] = None
    except RuntimeError as error:
        seen["cpu generator"] = str(error)
    return seen


def _checkpointed_dropout_grads():
    """Whether activation checkpointing's replay (it restores the device's RNG state) redraws the same dropout."""
    from torch.utils.checkpoint import checkpoint

    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)).to("npu")
    x = torch.randn(4, 8, device="npu")
    grads = []
    for checkpointed in (False, True):
        layer.zero_grad()
        torch.npu.manual_seed(11)
        out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        out.sum().backward()
        grads.append(layer[0].weight.grad.cpu())
    return torch.equal(*grads)


def test_generators_draw_reproducibly_from_seed_and_offset():
    seen = in_one_rank(_generator_draws)
    assert seen["generator"] == (True, "npu:0", "npu:1", True)
    assert seen["reseeded"] and not seen["other seed"] and seen["as the CPU's"]
    assert seen["advances"] == (True, 16)  # Philox-like: the offset moved past the 2 x 8 numbers drawn
    assert seen["F.dropout reseeded"] and seen["F.dropout as the CPU's"]
    assert seen["state replays"] == (True, torch.uint8, 16)
    assert seen["checkpoint"]
    assert seen["cpu generator"] == "Expected a 'npu' device type for generator but found 'cpu'"


STEPS = 4


def _amp_training(rank, world_size, device_type):
    """Autocast bf16, GradScaler, FSDP2 with CPU offload and clipping, ``STEPS`` steps; what each step gave."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import comm

    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    comm.equip()  # the hccl group stages the CPU tensors: the offloaded gradients' norm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    mesh = init_device_mesh(device_type, (world_size,))
    policy = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device_type, init_scale=2.0**10, growth_interval=2)
    seen = {"losses": [], "norms": [], "scales": []}
    for step in range(STEPS):
        data = torch.Generator().manual_seed(100 * step + rank)
        batch, target = torch.randn(6, 8, generator=data), torch.randn(6, 4, generator=data)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = model(batch.to(device))
            loss = F.mse_loss(out, target.to(device))
        seen["dtypes"] = (out.dtype, loss.dtype)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen["losses"].append(loss.item())
        seen["norms"].append(norm.full_tensor().item())
        seen["scales"].append(scaler.get_scale())
    seen["parameters"] = [p.full_tensor().detach().cpu() for p in model.parameters()]
    seen["offloaded"] = sorted({p.to_local().device.type for p in model.parameters()})
    return seen


def test_amp_step_on_two_npus_trains_as_on_cpu_gloo():
    """The step on two simulated NPUs (hccl) against the same step on two CPU ranks (gloo).

    Both autocast the same operators to bfloat16 (linear; mse_loss stays float32 in
    CUDA's policy and in the CPU's), and the NPU's operators are the CPU's kernels, so
    the runs agree to float32 rounding: tolerance 1e-6 relative.
    """
    on_npu = run_ranks(_amp_training, 2, backend="hccl", simulate=NPU, args=("npu",), timeout=300)
    on_cpu = run_ranks(_amp_training, 2, backend="gloo", args=("cpu",), timeout=300)
    for npu_rank, cpu_rank in zip(on_npu, on_cpu):
        assert npu_rank["dtypes"] == cpu_rank["dtypes"] == (torch.bfloat16, torch.float32)
        assert npu_rank["offloaded"] == ["cpu"]
        assert npu_rank["scales"] == cpu_rank["scales"] == [2.0**10, 2.0**11, 2.0**11, 2.0**12]
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(npu_rank[key]), torch.tensor(cpu_rank[key]), rtol=1e-6, atol=0)
        for mine, theirs in zip(npu_rank["parameters"], cpu_rank["parameters"]):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert on_npu[0]["norms"] == on_npu[1]["norms"]  # one norm over both ranks' shards
    assert max(on_npu[0]["norms"]) > 0.5  # clipping had something to clip
