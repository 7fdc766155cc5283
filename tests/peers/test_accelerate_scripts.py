"""Accelerate's own distributed test scripts, unchanged, on two simulated NPUs and on the CPU, plainly and under comm.

HF Accelerate ships the scripts its CI runs on every accelerator in its wheel
(``accelerate/test_utils/scripts/``): they check ``gather``, ``reduce``, ``broadcast``,
padding across processes, gradient synchronisation and accumulation, data loaders
across ranks, mixed precision and merging FSDP checkpoints, each asserting what it
expects itself. Each runs under ``torchrun --nproc-per-node 2`` four ways:

* ``-m comm --simulate npu``: must pass, as on an Ascend machine with comm;
* plainly on the simulated NPU (no comm): as on an Ascend machine without comm; must
  pass too (Accelerate's own device handling suffices there);
* ``-m comm`` on the CPU and plainly on the CPU: comm must change nothing there (both pass, or both fail
  as ``ON_THE_CPU_FAILS`` says). Both with ``ACCELERATE_USE_CPU=1``, as ``accelerate launch --cpu`` sets it,
  but for ``CPU_JOBS_OF_ONE``: without it Accelerate runs each CPU rank as a job of one, and test_script's two
  "main processes" race to delete the same file.

Beside them one script of comm's own (``accelerate_cpu_metric.py``) through Accelerate's public
operations: a metric on the CPU, gathered and reduced on two simulated NPUs, fails plainly with the
second seed's error and must pass under comm, so that the tier can fail for comm's reason.

Run by ``make test-peers`` (its own venv, tests/peers/requirements.txt), not ``make test``.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from multiproc import SEED_ERROR, quiet_env, skip_unless_simulation

accelerate = pytest.importorskip("accelerate", reason="make test-peers installs Accelerate in .venv-peers")

SCRIPTS = Path(accelerate.__file__).resolve().parent / "test_utils" / "scripts"
# Sets the simulated NPU up and runs a script as `python script.py` would: no comm.
ON_SIMULATED_NPU = Path(__file__).resolve().parent.parent / "clients" / "on_simulated_npu.py"
NAMES = ["test_script", "test_ops", "test_sync", "test_distributed_data_loop", "test_merge_weights"]
# What a script says on the CPU, plainly and under comm alike, where it fails there.
ON_THE_CPU_FAILS = {
    "test_distributed_data_loop": "this script expects that two GPUs are available",
    "test_merge_weights": "KeyError: None",  # FSDP's set_state_dict_type, given no state-dict type on the CPU
}
# Scripts run on the CPU as two jobs of one rank each: as one job of two CPU ranks, test_distributed_data_loop
# waits for ever plainly (Accelerate 1.15.0, torch 2.13.0); as jobs of one it stops at once, asking for GPUs.
CPU_JOBS_OF_ONE = {"test_distributed_data_loop"}


# comm's own script through Accelerate's operations (see the module docstring).
CPU_METRIC = Path(__file__).resolve().parent / "accelerate_cpu_metric.py"


def run(script: str, *launch: str, on_the_cpu: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 <launch> <script>``; rank 0's output only (tracebacks interleave).

    ``script``: the name of one of Accelerate's scripts, or a path. ``on_the_cpu``: Accelerate's two ranks on the
    CPU, as one job of two (``ACCELERATE_USE_CPU=1``).
    """
    path = script if script.endswith(".py") else str(SCRIPTS / f"{script}.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--local-ranks-filter", "0", *launch, path]
    with tempfile.TemporaryDirectory() as folder:  # test_merge_weights saves its checkpoint in the current folder
        env = {**quiet_env(), "ACCELERATE_USE_CPU": "1"} if on_the_cpu else quiet_env()
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=folder)


def failure(result: subprocess.CompletedProcess) -> str:
    """The tail of what the script printed where it failed; '' where it passed."""
    return "" if result.returncode == 0 else (result.stdout + result.stderr)[-3000:]


@pytest.mark.parametrize("script", NAMES)
def test_on_simulated_npus_under_comm(script):
    skip_unless_simulation()
    result = run(script, "-m", "comm", "--simulate", "npu")
    assert not failure(result), failure(result)


@pytest.mark.parametrize("script", NAMES)
def test_on_simulated_npus_without_comm(script):
    skip_unless_simulation()
    result = run(script, str(ON_SIMULATED_NPU))
    assert not failure(result), failure(result)


@pytest.mark.parametrize("script", NAMES)
def test_on_the_cpu_comm_changes_nothing(script):
    one_job = script not in CPU_JOBS_OF_ONE
    plain, under_comm = run(script, on_the_cpu=one_job), run(script, "-m", "comm", on_the_cpu=one_job)
    if script in ON_THE_CPU_FAILS:
        for result in (plain, under_comm):
            assert result.returncode != 0 and ON_THE_CPU_FAILS[script] in result.stdout + result.stderr
    else:
        assert not failure(plain), failure(plain)
        assert not failure(under_comm), failure(under_comm)


def test_merge_weights_twenty_runs_in_a_row_without_a_hang():
    """FSDP's unshard on the simulated NPU once hung one run in three: the host held Python's lock while it waited
    for a collective that gloo's thread could not finish without that lock (comm/testing/csrc/simulated.h)."""
    skip_unless_simulation()
    for attempt in range(20):
        result = run("test_merge_weights", "-m", "comm", "--simulate", "npu")
        assert not failure(result), f"run {attempt + 1}: {failure(result)}"


def test_a_cpu_metric_through_accelerates_operations_needs_comm_on_npus():
    """Plainly, Accelerator.gather of a CPU tensor on the hccl group fails with the second seed's error; under comm
    it and Accelerator.reduce answer right, as they do plainly on the CPU."""
    skip_unless_simulation()
    plain = run(str(CPU_METRIC), str(ON_SIMULATED_NPU))
    assert plain.returncode != 0 and SEED_ERROR in plain.stdout + plain.stderr, failure(plain) or plain.stdout
    for result in (run(str(CPU_METRIC), "-m", "comm", "--simulate", "npu"), run(str(CPU_METRIC), on_the_cpu=True)):
        assert not failure(result) and result.stdout.strip().splitlines()[-1:] == ["right"], failure(result)
