"""What torch does without comm, it does under comm, wherever CUDA is not named; CUDA names land on the accelerator.

The corpus of device idioms (tests/device_idioms.py: factories in every device form,
device contexts, the default device, meta initialisation, checkpoints, generators,
autocast, process groups, pickling, torch.fx, compile) runs under ``python -m comm`` on
this CPU-only machine and under ``python -m comm --simulate npu``, and each idiom's
description is compared with its plain reference: the same code, run on plain torch,
with its CUDA names replaced by the target's device (the CPU, or ``npu``/``npu:N``).
An idiom that names no CUDA is compared with itself, run plainly.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from device_idioms import IDIOMS

from comm.translate import calls, cuda

from multiproc import quiet_env, skip_unless_simulation

RUNNER = str(Path(__file__).resolve().parent / "device_idioms.py")
# The stand-ins whose calls an idiom shows by another name than the attribute they stand in.
SHOWN_AS = {"DistributedDataParallel": "DDP(", "DataLoader": "DataLoader(", "autocast": "torch.autocast(",
            "GradScaler": "GradScaler(", "DeviceContext": "with torch.device(", "cuda": "torch.cuda.",
            "torch.cuda": "torch.cuda."}


def described(*launch: str) -> dict:
    """Every idiom's description, run by ``python <launch> device_idioms.py``.

    The descriptions come back in a file: stdout also carries what backends print (gloo on torch 2.9 says
    which peers it connected to).
    """
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "idioms.json"
        run = subprocess.run([sys.executable, *launch, "--out", str(out)], capture_output=True, text=True,
                             env=quiet_env(), timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(out.read_text())


def differences(reference: dict, under_comm: dict) -> str:
    return "\n".join(f"{name}:\n  plain     {reference[name]}\n  under comm {under_comm[name]}"
                     for name in reference if reference[name] != under_comm[name])


@pytest.mark.integration  # whole programs, plainly and under python -m comm (docs/testing.md)
@pytest.mark.parametrize("target", ["cpu", "npu"])
def test_every_idiom_under_comm_gives_what_plain_torch_gives(target):
    """Each idiom under ``-m comm`` (CPU) or ``-m comm --simulate npu`` against its plain reference on that target."""
    if target == "npu":
        skip_unless_simulation()
    reference = described(RUNNER, "--reference", target)
    under_comm = described("-m", "comm", *(["--simulate", "npu"] if target == "npu" else []), RUNNER)
    assert set(reference) == {idiom.name for idiom in IDIOMS} == set(under_comm)
    assert not differences(reference, under_comm), differences(reference, under_comm)
    broken = [name for name, text in under_comm.items() if text.startswith("child")]
    assert not broken, broken


# The idioms naming CUDA that plain torch runs on a CPU-only machine, and what it does instead.
RUN_PLAINLY = {
    "torch.amp.GradScaler('cuda')": "the scaler warns and disables itself: fp16 would train unscaled",
    "DataLoader(pin_memory=True)": "the loader warns and does not pin",
    "torch.fx traces a factory and Tensor.to": "tracing records the call without running it",
}


@pytest.mark.integration
def test_the_idioms_naming_cuda_fail_on_plain_torch_here():
    """The CUDA idioms are not vacuous: as written, plain torch on this CPU-only machine cannot run them."""
    plain = described(RUNNER, "--as-written")
    cuda_named = [idiom.name for idiom in IDIOMS if re.search(r"\bcuda\b|nccl", idiom.code)
                  and "pickle" not in idiom.name]
    ran = sorted(name for name in cuda_named if not plain[name].startswith("raises"))
    assert ran == sorted(RUN_PLAINLY), f"idioms naming CUDA that plain torch ran here: {ran}"


def test_every_stand_in_of_the_translation_appears_in_an_idiom():
    corpus = "\n".join(idiom.code for idiom in IDIOMS)
    stand_ins = {(getattr(owner, "__name__", "sys.modules"), name)
                 for owner, name, _ in calls.targets() + cuda.targets()}
    missing = sorted(f"{owner}.{name}" for owner, name in stand_ins
                     if SHOWN_AS.get(owner if name == "__init__" else name, f"{name}(") not in corpus)
    assert not missing, f"stand-ins no idiom calls: {missing}"
