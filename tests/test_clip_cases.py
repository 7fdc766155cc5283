"""torch's clip_grad_norm_ answers under ``python -m comm`` exactly as it does plainly, wherever plain torch runs it.

The cases (tests/clip_cases.py: local tensors, one tensor, no gradients, norm types,
``foreach``, bfloat16, non-finite norms, ``max_norm`` 0, ``main_grad`` beside ``.grad``,
DDP, FSDP2 with and without CPU offload, HSDP, FSDP2 with tensor parallelism) run on two
ranks under torchrun, plainly and under ``-m comm``, on the CPU (gloo) and on two
simulated NPUs (hccl); every rank's description (the returned tensor's type, placements,
dtype, device and exact value; every gradient's exact values afterwards; or the error)
must be identical. Where plain torch fails on the NPU with the second seed's error (the
norm of CPU-offloaded gradients on an hccl group), comm's answer must be plain torch's on
the CPU, value for value.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import pytest

import comm

from multiproc import SEED_ERROR, quiet_env, skip_unless_simulation

# Whole programs under torchrun, plainly and under -m comm: the integration tier (docs/testing.md).
pytestmark = [pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason())),
              pytest.mark.integration]

RUNNER = str(Path(__file__).resolve().parent / "clip_cases.py")
# Plain torch cannot reduce the norm of CPU-offloaded gradients on an hccl group: the second seed.
SEED_CASES = {"FSDP2 with CPUOffloadPolicy"}


def described(*launch: str) -> List[Dict[str, dict]]:
    """Each rank's case descriptions, from ``torchrun --nproc-per-node 2 <launch>``."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   *launch, "--out", folder]
        run = subprocess.run(command, capture_output=True, text=True, env=quiet_env(), timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        return [json.loads((Path(folder) / f"rank{rank}.json").read_text()) for rank in range(2)]


def differences(plain: List[Dict[str, dict]], other: List[Dict[str, dict]], cases=None) -> str:
    return "\n".join(f"rank {rank}, {name}:\n  plain      {ours[name]}\n  under comm {theirs[name]}"
                     for rank, (ours, theirs) in enumerate(zip(plain, other))
                     for name in (cases or ours) if ours[name] != theirs[name])


def test_every_clip_case_under_comm_on_the_cpu_is_plain_torchs():
    plain = described(RUNNER)
    under_comm = described("-m", "comm", RUNNER)
    assert not differences(plain, under_comm), differences(plain, under_comm)
    # A DTensor (Replicate; Partial on torch 2.9, pytorch#170862), where the drop-in mode once answered a Tensor.
    assert plain[0]["FSDP2"]["returned"].startswith("DTensor(")


def test_every_clip_case_under_comm_on_simulated_npus_is_plain_torchs():
    skip_unless_simulation()
    plain = described(RUNNER, "--simulate", "npu")
    under_comm = described("-m", "comm", "--simulate", "npu", RUNNER)
    runs_plainly = [name for name in plain[0] if name not in SEED_CASES]
    assert not differences(plain, under_comm, runs_plainly), differences(plain, under_comm, runs_plainly)
    for rank in plain:
        for name in SEED_CASES:
            assert rank[name]["returned"] == f"raises RuntimeError: {SEED_ERROR}"
    on_the_cpu = described(RUNNER, "--only", "FSDP2 with CPUOffloadPolicy")
    assert not differences(on_the_cpu, under_comm), differences(on_the_cpu, under_comm)


def test_the_tier_tells_comms_own_clip_from_torchs():
    """Not vacuous: comm.clip_grad_norm_ in torch's place differs where its documented extensions do."""
    plain = described(RUNNER)
    stand_in = described(RUNNER, "--clip", "comm")
    differing = {name for name in plain[0] if plain[0][name] != stand_in[0][name]}
    assert {"main_grad beside .grad", "FSDP2", "FSDP2 and tensor parallel (dp 1, tp 2)"} <= differing
