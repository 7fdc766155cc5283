"""Real frameworks, unchanged, on two simulated NPUs: plainly, under ``torchrun -m comm``, and against a reference.

Each client script (this folder) has no comm line. It runs three ways:

* **plain**: ``torchrun --nproc-per-node 2 on_simulated_npu.py script.py``: the simulated
  NPU and its hccl backend, no comm, as on an Ascend machine without comm. Where the
  framework fails there, the test asserts the failure users report;
* **comm**: ``torchrun --nproc-per-node 2 -m comm --simulate npu script.py``: must train;
* **reference**: one process computing the same steps on the CPU with plain torch
  (the union of the ranks' batches, whose gradient is the ranks' average), or the
  framework's own run on a CPU-only machine without comm; losses and gradient norms
  (or parameter checksums) must agree within ``TOLERANCE``.

Megatron-core's DDP also runs on a CPU-only machine under ``-m comm`` (gloo), with no
simulation. A case that fails for a known comm bug is ``xfail(strict=True)`` naming
it, so that the tier stays green and says so when the fix lands.

Run by ``make test-clients`` (its own venv, tests/clients/requirements.txt; LLaMA-Factory's
tests in another, tests/clients/llamafactory-requirements.txt, ms-swift's in a third,
tests/clients/swift-requirements.txt, and verl's in a fourth, tests/clients/verl-requirements.txt),
not by ``make test``.
"""

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from multiproc import SEED_ERROR, quiet_env, skip_unless_simulation

CLIENTS = Path(__file__).resolve().parent
# float32 sums of the same values in another order (sharded, then reduced) differ in the last bits.
TOLERANCE = {"rel": 1e-5, "abs": 1e-6}
STEP = re.compile(r"rank (\d): step (\d+) loss (\S+) (?:grad_norm|checksum) (\S+)")
# What a script written for CUDA meets first on Ascend without comm: torch's CPU build has no CUDA bindings.
NO_CUDA_BINDINGS = "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'"


def torchrun(script, *args, mode, rank_0_only=False, **env):
    """Run tests/clients/``script`` on two ranks: ``mode`` is plain, comm, cpu (-m comm, no simulation) or reference.

    ``env`` adds variables to the ranks' environment. ``rank_0_only`` shows rank 0's output alone (torchrun's
    ``--local-ranks-filter``): for runs that fail, where both ranks' tracebacks in one pipe can interleave
    mid-line and split the error a test looks for."""
    if mode in ("plain", "comm"):
        skip_unless_simulation()
    launch = {
        "plain": [str(CLIENTS / "on_simulated_npu.py")],
        "comm": ["-m", "comm", "--simulate", "npu"],
        "cpu": ["-m", "comm"],
        "reference": [],
    }[mode]
    shown = ["--local-ranks-filter", "0"] if rank_0_only else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *shown,
               *launch, str(CLIENTS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, env=quiet_env(**env), timeout=300)


@functools.lru_cache(maxsize=None)
def reference_run(script, *args):
    """The framework's own run of ``script`` on a CPU-only machine, without comm (run once per session).

    Plain torch (2.13 on) sometimes aborts a rank at exit, after the run ended, with
    ``terminate called without an active exception``: gloo's worker thread, starved of the
    interpreter lock, releases a collective issued during backward after Python began
    finalizing (comm/_interpreter_exit.py, which spares runs under comm). The oracle run is
    then made again, once.
    """
    run = torchrun(script, *args, mode="reference")
    if run.returncode != 0 and "terminate called without an active exception" in run.stderr:
        run = torchrun(script, *args, mode="reference")
    assert run.returncode == 0, run.stderr
    return run


@functools.lru_cache(maxsize=None)
def one_process_run(script, *args):
    """The stdout of ``python script args`` in one process on the CPU: no torchrun, no comm (run once per session).

    The reference of a framework whose steps one process can make on the union of the ranks' batches
    (FunASR's own trainer with ``++device=cpu``; verl's steps in plain torch, as verl has no CPU road)."""
    run = subprocess.run([sys.executable, str(CLIENTS / script), *args],
                         capture_output=True, text=True, env=quiet_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def client(name):
    """tests/clients/``name``.py as a module, for its model, data and constants."""
    spec = importlib.util.spec_from_file_location(name, CLIENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def steps(stdout):
    """Per step: the mean over the ranks of their losses, and the norm or checksum (which every rank must agree on)."""
    found = {}
    for rank, step, loss, value in STEP.findall(stdout):
        found.setdefault(int(step), {})[int(rank)] = (float(loss), float(value))
    assert found, stdout
    means, values = [], []
    for _, ranks in sorted(found.items()):
        assert len({value for _, value in ranks.values()}) == 1, ranks
        means.append(sum(loss for loss, _ in ranks.values()) / len(ranks))
        values.append(next(iter(ranks.values()))[1])
    return means, values


def one_process(module, optimizer_class, max_norm=None, checksum=False, **optimizer_options):
    """The client's steps in one process on the CPU: the whole batch, torch's optimizer and clip.

    Returns per step the loss and the norm before clipping (or the parameters' sum after the step)."""
    model = module.make_model()
    optimizer = optimizer_class(model.parameters(), **optimizer_options)
    losses, values = [], []
    for step in range(module.STEPS):
        inputs, targets = module.batch(step)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
        optimizer.step()
        losses.append(loss.item())
        values.append(sum(p.double().sum().item() for p in model.parameters()) if checksum else norm.item())
    return losses, values


def assert_matches(stdout, reference):
    losses, values = steps(stdout)
    assert losses == pytest.approx(reference[0], **TOLERANCE)
    assert values == pytest.approx(reference[1], **TOLERANCE)


def assert_ran_on(stdout, where, ranks=(0, 1)):
    """Every step of ``ranks`` reports ``where`` (``{rank}`` filled in): the framework trained there, not elsewhere.

    Searched in the whole output, as :data:`STEP` is: the ranks' lines share one pipe and
    may run together where a ``print`` writes its text and its newline apart.
    """
    for rank in ranks:
        step = rf"rank {rank}: step \d+ loss \S+ \w+ \S+ on "
        reported = re.findall(step, stdout)
        there = re.findall(step + re.escape(where.format(rank=rank)), stdout)
        assert reported and len(there) == len(reported), stdout


def assert_fails_with(run, error):
    assert run.returncode != 0 and error in run.stderr, run.stderr[-3000:]


# torchao: imported, as torchtitan's converters import it.

def test_torchao_imports_plainly_on_the_simulated_npu():
    run = torchrun("torchao_import.py", mode="plain")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("torchao 0.18.0 imported 3 modules; cuda available False") == 2


def test_torchao_imports_under_comm_on_the_simulated_npu():
    run = torchrun("torchao_import.py", mode="comm")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("torchao 0.18.0 imported 3 modules") == 2


def test_torchao_imports_under_comm_on_a_cpu_only_machine():
    run = torchrun("torchao_import.py", mode="cpu")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("torchao 0.18.0 imported 3 modules") == 2


# Accelerate: gather, reduce and broadcast; torch's values are the reference.

TORCH_VALUES = {"reduce": "[3.0]", "broadcast": "[1.0]", "gather": "[1.0, 2.0]"}


def assert_accelerate_values(stdout, on, ops, device):
    for rank in (0, 1):
        for op in ops:
            assert f"rank {rank}: {on} {op} {TORCH_VALUES[op]} on {device} (hccl)" in stdout, stdout


def test_accelerate_collectives_plainly_on_the_simulated_npu():
    """NPU tensors work on Accelerate's hccl group; each operation on CPU tensors fails as on Ascend."""
    run = torchrun("accelerate_collectives.py", "--on", "accelerator", mode="plain")
    assert run.returncode == 0, run.stderr
    assert_accelerate_values(run.stdout, "accelerator", TORCH_VALUES, "npu")
    for op in TORCH_VALUES:
        run = torchrun("accelerate_collectives.py", "--on", "cpu", "--ops", op, mode="plain", rank_0_only=True)
        assert_fails_with(run, SEED_ERROR)


def test_accelerate_collectives_under_comm():
    for on, device in (("accelerator", "npu"), ("cpu", "cpu")):
        run = torchrun("accelerate_collectives.py", "--on", on, "--ops", "reduce,broadcast", mode="comm")
        assert run.returncode == 0, run.stderr
        assert_accelerate_values(run.stdout, on, ("reduce", "broadcast"), device)


def test_accelerate_gather_of_cpu_tensors_under_comm():
    """Accelerate gathers a CPU tensor into an output on the accelerator."""
    run = torchrun("accelerate_collectives.py", "--on", "cpu", "--ops", "gather", mode="comm")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_accelerate_values(run.stdout, "cpu", ("gather",), "npu")


def test_accelerate_fsdp2_offload_clip_fails_plainly_and_matches_one_process_under_comm():
    assert_fails_with(torchrun("accelerate_fsdp2_clip.py", mode="plain", rank_0_only=True), SEED_ERROR)
    run = torchrun("accelerate_fsdp2_clip.py", mode="comm")
    assert run.returncode == 0, run.stderr
    assert_ran_on(run.stdout, "npu (hccl)")
    assert_matches(run.stdout, one_process(client("accelerate_fsdp2_clip"), torch.optim.SGD, max_norm=0.5, lr=0.1))


# DeepSpeed ZeRO-3 with CPU offload.

def test_deepspeed_zero3_fails_plainly_on_the_simulated_npu():
    """DeepSpeed initialises on the NPU (its accelerator, hccl); the script's ``torch.cuda.set_device`` then fails."""
    run = torchrun("deepspeed_zero3.py", mode="plain", rank_0_only=True)
    assert_fails_with(run, NO_CUDA_BINDINGS)
    assert "rank 0: step" not in run.stdout, run.stdout


def test_deepspeed_zero3_offload_under_comm_matches_one_process():
    run = torchrun("deepspeed_zero3.py", mode="comm")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran_on(run.stdout, "npu:{rank}")
    assert_matches(run.stdout, one_process(client("deepspeed_zero3"), torch.optim.AdamW, max_norm=0.5, lr=0.01))


# Lightning DDP with sync_dist and torchmetrics' compute_on_cpu; the reference is Lightning's own CPU run.

LIGHTNING_STEP = re.compile(r"rank 0: step (\d) loss (\S+) on (\w+)")
LIGHTNING_ERROR = re.compile(r"rank 0: mean absolute error (\S+)")


def assert_lightning_matches_its_cpu_run(stdout):
    reference = reference_run("lightning_ddp.py", "--accelerator", "cpu").stdout
    losses = [float(loss) for _, loss, _ in LIGHTNING_STEP.findall(stdout)]
    assert len(losses) == 3, stdout
    assert losses == pytest.approx([float(loss) for _, loss, _ in LIGHTNING_STEP.findall(reference)], **TOLERANCE)
    assert float(LIGHTNING_ERROR.search(stdout)[1]) == pytest.approx(float(LIGHTNING_ERROR.search(reference)[1]),
                                                                     **TOLERANCE)


def test_lightning_cuda_path_fails_plainly_on_the_simulated_npu():
    run = torchrun("lightning_ddp.py", "--accelerator", "cuda", mode="plain", rank_0_only=True)
    assert_fails_with(run, "`CUDAAccelerator` can not run on your system since the accelerator is not available")


@pytest.mark.parametrize("accelerator", ["auto", pytest.param("cuda", id="accelerator-cuda")])  # not the cuda mark
def test_lightning_ddp_under_comm_matches_its_cpu_run(accelerator):
    run = torchrun("lightning_ddp.py", "--accelerator", accelerator, mode="comm")
    assert run.returncode == 0, run.stderr[-3000:]
    assert {device for _, _, device in LIGHTNING_STEP.findall(run.stdout)} == {"npu"}
    assert_lightning_matches_its_cpu_run(run.stdout)


# Megatron-core's DDP, written for CUDA.

def megatron_reference():
    module = client("megatron_ddp")
    return one_process(module, torch.optim.SGD, checksum=True, lr=module.LEARNING_RATE)


def test_megatron_ddp_fails_plainly_on_the_simulated_npu():
    assert_fails_with(torchrun("megatron_ddp.py", mode="plain", rank_0_only=True), NO_CUDA_BINDINGS)


@pytest.mark.parametrize("mode, device", [("comm", "npu:{rank} (hccl)"), ("cpu", "cpu (gloo)")], ids=["comm", "cpu"])
def test_megatron_ddp_under_comm_matches_one_process(mode, device):
    run = torchrun("megatron_ddp.py", mode=mode)
    assert run.returncode == 0, run.stderr
    assert_ran_on(run.stdout, device)
    assert_matches(run.stdout, megatron_reference())


# transformers' Trainer; the reference is its own run on a CPU-only machine (Accelerate's DDP over gloo).

def test_transformers_trainer_fails_plainly_on_the_simulated_npu():
    """Trainer runs on Ascend's hccl group; its clip of the CPU-offloaded FSDP2 gradients fails as users report."""
    run = torchrun("transformers_trainer.py", mode="plain", rank_0_only=True)
    assert_fails_with(run, SEED_ERROR)
    assert "rank 0: step" not in run.stdout, run.stdout


@pytest.mark.parametrize("mode, device", [("comm", "npu"), ("cpu", "cpu")])
def test_transformers_trainer_under_comm_matches_its_cpu_run(mode, device):
    run = torchrun("transformers_trainer.py", mode=mode)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran_on(run.stdout, device)
    reference = steps(reference_run("transformers_trainer.py").stdout)
    losses, norms = steps(run.stdout)
    assert len(losses) == 3
    assert (losses, norms) == (pytest.approx(reference[0], **TOLERANCE), pytest.approx(reference[1], **TOLERANCE))


# torchtitan's Trainer on its llama3 debug model, FSDP2 with CPU offload: it picks the NPU itself,
# builds the model on the meta device and its RoPE cache under ``with torch.device(...)``; the
# reference is its own plain run on the simulated NPU.

TORCHTITAN_DEVICE = "npu:{rank} (npu:hccl,cpu:gloo)"


@functools.lru_cache(maxsize=None)
def torchtitan_plain_run():
    run = torchrun("torchtitan_llama.py", mode="plain")
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_torchtitan_trains_plainly_on_the_simulated_npu():
    """Without comm torchtitan trains on Ascend: it chooses the NPU and a group serving the NPU and the CPU."""
    run = torchtitan_plain_run()
    assert_ran_on(run.stdout, TORCHTITAN_DEVICE)
    losses, _ = steps(run.stdout)
    assert len(losses) == client("torchtitan_llama").STEPS


def test_torchtitan_fails_plainly_on_a_cpu_only_machine():
    """On a CPU-only machine torchtitan takes the CUDA road (its device_type falls back to "cuda")."""
    assert_fails_with(torchrun("torchtitan_llama.py", mode="reference", rank_0_only=True), NO_CUDA_BINDINGS)


@pytest.mark.parametrize("translate", ["1", "0"], ids=["translation-on", "translation-off"])
def test_torchtitan_under_comm_trains_as_it_does_plainly(translate):
    """Under ``-m comm`` the meta device, ``with torch.device(...)`` and the default device act as plainly:
    the same losses and gradient norms, on the same devices."""
    run = torchrun("torchtitan_llama.py", mode="comm", COMM_TRANSLATE=translate)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran_on(run.stdout, TORCHTITAN_DEVICE)
    reference = steps(torchtitan_plain_run().stdout)
    assert steps(run.stdout) == (pytest.approx(reference[0], **TOLERANCE), pytest.approx(reference[1], **TOLERANCE))


# FunASR's own trainer (funasr.bin.train): a Transformer with the conv2d input layer, DDP, written for CUDA
# and NCCL. The numbers are those of FunASR's checkpoint after each step (rank 0 saves them); the reference
# is FunASR's own run in one process on the CPU (``++device=cpu``) on the union of the ranks' batches.

FUNASR_LOGGED = re.compile(r"train, rank: (\d), epoch: 0/1, data_slice: 0/1, step_in_slice: (\d+)/\d+, "
                           r".*?\(loss_avg_rank: (\S+)\)")
FUNASR_VALIDATION = re.compile(r"rank 0: step (\d+) loss \S+ checksum \S+ on (\S+) \(validation loss (\S+)\)")




def funasr_logged(stdout):
    """Per step, the mean over the ranks of the loss each logged (FunASR's text log: 3 decimals)."""
    found = {}
    for rank, step, loss in FUNASR_LOGGED.findall(stdout):
        found.setdefault(int(step), {})[int(rank)] = float(loss)
    return [sum(ranks.values()) / len(ranks) for _, ranks in sorted(found.items())], found


@pytest.mark.parametrize("backend, error", [
    (None, "RuntimeError: Distributed package doesn't have NCCL built in"),
    ("hccl", NO_CUDA_BINDINGS),
], ids=["default-nccl", "backend-hccl"])
def test_funasr_fails_plainly_on_the_simulated_npu(backend, error):
    """FunASR's ``init_process_group("nccl")`` fails; given ``++backend=hccl``, its ``torch.cuda.set_device``."""
    run = torchrun("funasr_train.py", *([f"++backend={backend}"] if backend else []), mode="plain", rank_0_only=True)
    assert_fails_with(run, error)
    assert "train, rank" not in run.stdout, run.stdout


def test_funasr_trains_under_comm_as_in_its_one_process_cpu_run():
    run = torchrun("funasr_train.py", mode="comm")
    assert run.returncode == 0, run.stderr[-3000:]
    reference = one_process_run("funasr_train.py", "++device=cpu")
    validation = FUNASR_VALIDATION.findall(run.stdout)
    assert [device for _, device, _ in validation] == ["npu:0"] * 3, run.stdout
    assert [device for _, device, _ in FUNASR_VALIDATION.findall(reference)] == ["cpu"] * 3, reference
    # Both ranks trained all 3 steps, each on its half: the mean of their logged losses is the one process's.
    logged, ranks = funasr_logged(run.stdout)
    assert [sorted(found) for found in ranks.values()] == [[0, 1]] * 3, run.stdout
    assert logged == pytest.approx(funasr_logged(reference)[0], abs=1.5e-3)
    assert_matches(run.stdout, steps(reference))
    assert [float(loss) for _, _, loss in validation] == pytest.approx(
        [float(loss) for _, _, loss in FUNASR_VALIDATION.findall(reference)], **TOLERANCE)


# Supervised fine-tuning stacks Ascend users train with, each in a venv of its own (make test-clients;
# tests/clients/<name>-requirements.txt says why): full fine-tuning of a tiny Llama, FSDP2 with CPU offload,
# clipping (tests/clients/tiny_sft.py). The reference is each one's own run on a CPU-only machine, where
# Accelerate shards nothing (it applies FSDP on accelerators only): replicated over gloo, the same gradients
# averaged over the ranks.
#
# * LLaMA-Factory 0.9.3 (``run_exp``): every release caps transformers and Accelerate below .venv-clients'
#   pins; 0.9.4 and 0.9.5 import torchaudio, which no wheel here loads on torch 2.13.0 CPU. transformers 4.52
#   imports torch_npu.npu_rotary_mul and LLaMA-Factory calls torch.npu.set_compile_mode: the simulated NPU's
#   stand-in torch_npu has both. Trainer 4.52 logs the loss rounded to 4 decimals (the gradient norm in full).
# * ms-swift 4.4.2 (``sft_main``, what ``swift sft`` runs, FSDP2 from a ``--fsdp`` JSON file): the newest
#   before ms-swift staged the clip of CPU-offloaded FSDP2 gradients by hand (PR #9844, in 4.5.0). It wraps
#   ``Accelerator.clip_grad_norm_`` (swift/trainers/mixin.py); in 4.4.2 the wrapper calls Accelerate's, which
#   fails on Ascend's hccl group.
# * verl 0.9.0's torchrun SFT trainer (``verl.trainer.sft_trainer.main``, its FSDP engine with ``strategy=fsdp2`` and
#   ``offload_policy=True``): the newest release whose trainer makes ``hccl`` alone (0.9.1 makes ``cpu:gloo,npu:hccl``).
#   Its own clip (verl/utils/fsdp_utils.py, fsdp2_clip_grad_norm_) moves the total norm to the device, but only after
#   torch's _get_total_norm has reduced it, on the CPU: it fails there. verl has no CPU road (below), so its reference
#   is one process on the CPU.

# name -> (script, a frame the plain run's traceback shows, or None)
SFT_CLIENTS = {
    "llamafactory": ("llamafactory_sft.py", None),
    "swift": ("swift_sft.py", r"swift/trainers/mixin\.py\", line \d+, in clip_grad_norm_"),
    "verl": ("verl_sft.py", r"verl/utils/fsdp_utils\.py\", line \d+, in fsdp2_clip_grad_norm_"),
}
SFT = [pytest.param(name, id=name, marks=pytest.mark.skipif(
    importlib.util.find_spec(name) is None, reason=f"{name} runs in .venv-{name} (make test-clients)"))
    for name in SFT_CLIENTS]
# Those whose own run on a CPU-only machine is their reference: all but verl.
SFT_WITH_A_CPU_RUN = [param for param in SFT if param.id != "verl"]


@pytest.mark.parametrize("name", SFT_WITH_A_CPU_RUN)
def test_sft_trains_on_a_cpu_only_machine(name):
    run = reference_run(SFT_CLIENTS[name][0])
    assert_ran_on(run.stdout, "cpu (not sharded, parameters on cpu)")
    assert len(steps(run.stdout)[0]) == 3


@pytest.mark.parametrize("name", SFT)
def test_sft_fails_plainly_on_the_simulated_npu(name):
    """It runs on Ascend's hccl group; the clip of the CPU-offloaded FSDP2 gradients fails (Trainer's, verl's)."""
    script, frame = SFT_CLIENTS[name]
    run = torchrun(script, mode="plain", rank_0_only=True)
    assert_fails_with(run, SEED_ERROR)
    assert frame is None or re.search(frame, run.stderr), run.stderr[-3000:]
    assert "rank 0: step" not in run.stdout, run.stdout


@pytest.mark.parametrize("name", SFT_WITH_A_CPU_RUN)
def test_sft_under_comm_matches_its_cpu_run(name):
    script = SFT_CLIENTS[name][0]
    run = torchrun(script, mode="comm")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran_on(run.stdout, "npu (fsdp2, parameters on cpu)")
    reference = steps(reference_run(script).stdout)
    losses, norms = steps(run.stdout)
    assert len(losses) == 3
    assert (losses, norms) == (pytest.approx(reference[0], **TOLERANCE), pytest.approx(reference[1], **TOLERANCE))


# verl: with no accelerator its platform falls back to NVIDIA's (verl/plugin/platform/platform_manager.py), so on a
# CPU-only machine its trainer asks for nccl. It logs on rank 0 only: the loss averaged over the ranks and the norm.

VERL = pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                          reason="verl runs in .venv-verl (make test-clients)")


@VERL
def test_verl_sft_fails_on_a_cpu_only_machine():
    """verl has no CPU platform: it takes NVIDIA's and its ``init_process_group("nccl")`` fails."""
    run = torchrun("verl_sft.py", mode="reference", rank_0_only=True)
    assert_fails_with(run, "RuntimeError: Distributed package doesn't have NCCL built in")
    assert "rank 0: step" not in run.stdout, run.stdout


@VERL
@pytest.mark.parametrize("mode, device", [("comm", "npu"), ("cpu", "cpu")])
def test_verl_sft_under_comm_matches_one_process(mode, device):
    """On two simulated NPUs, and on a CPU-only machine, where comm makes verl's nccl group gloo and its
    ``TensorDict.to(0)`` (torch's ``_parse_to``) lands on the CPU."""
    run = torchrun("verl_sft.py", mode=mode)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_ran_on(run.stdout, f"{device} (fsdp2, parameters on cpu)", ranks=(0,))
    reference = one_process_run("verl_sft.py", "--one-process")
    assert_ran_on(reference, "cpu (one process, parameters on cpu)", ranks=(0,))
    assert len(steps(run.stdout)[0]) == 3
    assert_matches(run.stdout, steps(reference))
