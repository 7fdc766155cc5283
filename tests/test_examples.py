"""The examples, run as users run them: under real torchrun, on the CPU and the simulated NPU."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import SEED_ERROR, free_port, quiet_env, skip_unless_simulation

pytestmark = pytest.mark.integration  # the integration tier: make test-integration

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name):
    """examples/``name``.py as a module, for the functions it defines."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dynamo looks functions' modules up by name
    spec.loader.exec_module(module)
    return module


def _torchrun(*args, timeout=240):
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(command, capture_output=True, text=True, env=quiet_env(), timeout=timeout)


def test_train_ddp_on_two_torchrun_nodes_over_loopback():
    """Two agents with a c10d rendezvous on 127.0.0.1, one simulated-NPU process each, DDP's backward included.

    (examples/bind_and_reduce.py's test binds rank r to npu:r on one node.)"""
    skip_unless_simulation()
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
              str(EXAMPLES / "train_ddp.py"), "--simulate", "npu", "--steps", "10"]
    command = [sys.executable, "-m", "torch.distributed.run"]
    nodes = [subprocess.Popen(command + common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=quiet_env()) for _ in range(2)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    printed = "".join(stdout for stdout, _ in outputs)
    losses = sorted(re.findall(r"rank (\d)/2: device=npu:0 backend=hccl final loss (\S+)", printed))
    assert [rank for rank, _ in losses] == ["0", "1"]
    assert losses[0][1] == losses[1][1]


def test_legacy_trainer_fails_as_is_and_works_under_python_m_comm():
    """The ranks stay in sync. (tests/test_collectives_compile.py compiles such a step under the patch.)"""
    skip_unless_simulation()
    script = [str(EXAMPLES / "legacy_trainer.py"), "--simulate", "npu", "--steps", "4"]
    plain = _torchrun("--standalone", "--nproc-per-node", "1", *script)  # one rank fails as every rank would
    assert plain.returncode != 0 and SEED_ERROR in plain.stderr
    patched = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "comm", *script)
    assert patched.returncode == 0, patched.stderr
    steps = sorted(re.findall(r"rank (\d): step (\d) mean loss (\S+)", patched.stdout))
    assert [(rank, step) for rank, step, _ in steps] == [(r, s) for r in "01" for s in "0123"]
    assert [loss for _, _, loss in steps[:4]] == [loss for _, _, loss in steps[4:]]  # every step's mean agrees
    lines = re.findall(r"rank (\d): mean loss (\S+) parameter checksum (\S+)", patched.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"]
    assert lines[0][1:] == lines[1][1:]  # the ranks stayed in sync


def test_fsdp2_offload_example_shows_the_failure_then_trains():
    skip_unless_simulation()
    result = _torchrun("--standalone", "--nproc-per-node", "2", str(EXAMPLES / "fsdp2_offload_clip.py"))
    assert result.returncode == 0, result.stderr
    assert "FSDP2 on 2 ranks (hccl), computing on npu, parameters and gradients offloaded to the CPU" in result.stdout
    assert "gradient shards on cpu, mesh on npu" in result.stdout  # what CPUOffloadPolicy leaves
    assert f"torch.nn.utils.clip_grad_norm_ fails: RuntimeError: {SEED_ERROR}" in result.stdout
    assert "comm.equip(): comm stages cpu on the group" in result.stdout
    rows = re.findall(r"^\s+(\d)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", result.stdout, re.MULTILINE)
    assert [int(step) for step, _, _, _ in rows] == [0, 1, 2, 3, 4]
    assert all(torch_norm == comm_norm for _, _, torch_norm, comm_norm in rows)  # torch's clip, then comm's norm
    staged = re.search(r"comm staged (\d+) all_reduce \(\d+ bytes moved\)", result.stdout)
    # Two per step (comm's norm, torch's clip), and a third where torch's clip returns this rank's
    # partial norm, which the example reduces (torch 2.9, pytorch#170862).
    assert staged and int(staged.group(1)) in (10, 15), result.stdout


def test_bind_and_reduce_on_cpu_and_simulated_npu():
    skip_unless_simulation()
    for extra, device, backend in [([], "cpu", "gloo"), (["--simulate", "npu"], "npu:{rank}", "hccl")]:
        result = _torchrun("--standalone", "--nproc-per-node", "2", str(EXAMPLES / "bind_and_reduce.py"), *extra)
        assert result.returncode == 0, result.stderr
        for rank in (0, 1):
            expected = f"rank {rank}/2: device={device.format(rank=rank)} backend={backend} all_reduce sum=3 ok"
            assert expected in result.stdout


def test_full_state_dict_of_offloaded_shards_fails_as_is_and_works_under_python_m_comm():
    skip_unless_simulation()
    script = [str(EXAMPLES / "full_state_dict.py"), "--simulate", "npu"]
    # Rank 0's output alone: two ranks' tracebacks in one pipe can interleave mid-line and split the error.
    plain = _torchrun("--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "0", *script)
    assert plain.returncode != 0 and SEED_ERROR in plain.stderr
    patched = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "comm", *script)
    assert patched.returncode == 0, patched.stderr
    assert "parameter shards on cpu, mesh on npu" in patched.stdout
    assert "full state dict: 6 tensors, 1476 values on ['cpu']; equal to the unsharded model's: True" in patched.stdout


def readme_example():
    """The Python block of README's "In a trainer", as written."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme.split("## In a trainer", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.mark.parametrize("simulate", [False, True], ids=["cpu_gloo", "simulated_npu_hccl"])
def test_readme_example_runs_as_written(tmp_path, simulate):
    """On a CPU-only box (gloo) and, as README's CPU-only line runs it, on two simulated NPUs (hccl, the CPU
    tensor staged): each rank prints the values its comment says."""
    if simulate:
        skip_unless_simulation()
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    under = ["-m", "comm", "--simulate", "npu"] if simulate else []
    # Each rank's stdout to a file of its own: two ranks' prints on one stream may interleave.
    logs = tmp_path / "logs"
    result = _torchrun("--standalone", "--nproc-per-node", "2", "--redirects", "1", "--log-dir", str(logs), *under,
                       str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    # The example's lines only: torch 2.9's gloo prints its connection count on stdout too.
    printed = sorted(line for path in logs.rglob("stdout.log") for line in path.read_text().splitlines()
                     if not line.startswith("[Gloo]"))
    assert printed == ["0 [4.0, 4.0, 4.0, 4.0]", "1 [4.0, 4.0, 4.0, 4.0]"], printed
