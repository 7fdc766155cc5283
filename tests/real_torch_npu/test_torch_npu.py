"""The real torch_npu wheel on comm's fake CANN (comm/testing/cann): torch_npu's own device runtime,
caching allocator, ProcessGroupHCCL and watchdog, plainly and under comm.

The second seed too: FSDP2 with CPU offload fails plainly at torch's clip and, under comm, makes
three steps that match one CPU process.

Run by ``make test-torch-npu`` in a venv of its own (.venv-torch-npu: the pinned torch and the
torch-npu wheel that pairs with it), not by ``make test``. Plainly (``python -m comm.testing.cann``)
a CPU tensor on torch_npu's hccl group fails as the first seed reports on hardware; under
``-m comm --simulate cann`` it is staged and right. This pytest process itself runs with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch would import torch_npu, which needs CANN, at
``import torch``); the processes it starts are on the fake.
"""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SEED_ERROR = "No backend type associated with device type cpu"
CALLS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "send_recv")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                                reason="needs torch_npu: make test-torch-npu installs it in .venv-torch-npu")


def torchrun(script, *args, comm):
    """``script`` on two ranks over the fake CANN: plainly, or under ``-m comm --simulate cann``."""
    under = ["-m", "comm", "--simulate", "cann"] if comm else []
    command = [sys.executable, "-m", "comm.testing.cann", "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *under, str(script), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "HCCL_EXEC_TIMEOUT": "60"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)  # the tier's pytest turns it off; torch_npu's users do not
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def outcomes(stdout):
    """{(rank, device, call): what happened} from collectives.py's lines."""
    found = {}
    for rank, device, call, outcome in re.findall(r"^rank (\d) (\w+) (\w+) (.*)$", stdout, re.MULTILINE):
        found[(int(rank), device, call)] = outcome
    return found


@pytest.fixture(scope="module")
def plain():
    return torchrun(HERE / "collectives.py", comm=False)


@pytest.fixture(scope="module")
def under_comm():
    return torchrun(HERE / "collectives.py", comm=True)


def test_npu_collectives_are_right_on_torch_npus_own_hccl(plain):
    found = outcomes(plain.stdout)
    for rank in (0, 1):
        for call in CALLS:
            assert found.get((rank, "npu", call)) == "ok", (call, plain.stdout, plain.stderr[-3000:])


def test_cpu_collectives_fail_plainly_as_the_seed_reports(plain):
    found = outcomes(plain.stdout)
    for rank in (0, 1):
        for call in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
            assert found.get((rank, "cpu", call), "").startswith("failed " + SEED_ERROR), (call, plain.stdout)


def test_every_collective_is_right_under_comm(under_comm):
    found = outcomes(under_comm.stdout)
    assert under_comm.returncode == 0, under_comm.stderr[-3000:]
    for rank in (0, 1):
        for device in ("npu", "cpu"):
            for call in CALLS:
                assert found.get((rank, device, call)) == "ok", (device, call, under_comm.stdout,
                                                                 under_comm.stderr[-3000:])


STEP = re.compile(r"^step (\d+) loss (\S+) grad_norm (\S+)$", re.MULTILINE)


def steps(stdout):
    """Each step's loss and gradient norm, in order, as one flat list."""
    return [float(value) for _, loss, norm in STEP.findall(stdout) for value in (loss, norm)]


def test_fsdp2_offload_clip_fails_plainly_at_torchs_clip_as_the_seed_reports():
    run = torchrun(HERE / "fsdp2_offload_clip.py", comm=False)
    assert run.returncode != 0
    assert "clip_grad_norm_" in run.stderr and "RuntimeError: " + SEED_ERROR in run.stderr, run.stderr[-3000:]


def test_fsdp2_offload_clip_trains_under_comm_as_one_cpu_process_does():
    run = torchrun(HERE / "fsdp2_offload_clip.py", comm=True)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = subprocess.run([sys.executable, str(HERE / "fsdp2_offload_clip.py"), "--reference"],
                               capture_output=True, text=True, timeout=300, check=True)
    got, want = steps(run.stdout), steps(reference.stdout)
    assert len(got) == len(want) == 6, (run.stdout, reference.stdout)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_dead_peer_ends_the_survivor_through_torch_npus_watchdog_within_the_timeout():
    started = time.monotonic()
    run = torchrun(HERE / "dead_peer.py", comm=False)
    assert run.returncode != 0 and "still running" not in run.stdout, run.stdout
    assert "HcclGetCommAsyncError" in run.stderr and "has exited" in run.stderr, run.stderr[-3000:]
    assert time.monotonic() - started < 60


def test_a_stream_waits_for_the_record_it_saw_not_a_later_one_on_another_stream():
    """The fake's events as a device's: FSDP2's streams re-record ProcessGroupHCCL's events; an earlier
    fake released such waits early and FSDP2's gradients came out wrong in about one run in three."""
    run = subprocess.run([sys.executable, "-m", "comm.testing.cann", str(HERE / "streams.py")], capture_output=True,
                         text=True, timeout=300, env={k: v for k, v in os.environ.items()
                                                      if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"})
    assert run.stdout.strip().splitlines()[-1:] == ["right"], (run.stdout, run.stderr[-3000:])
