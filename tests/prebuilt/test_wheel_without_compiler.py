"""The platform wheel (make wheel) as a user installs it: a fresh venv, no compiler, no ninja, staging at once.

    make test-wheel                  # the wheel for the pinned torch, installed with that torch
    make test-wheel TORCH=2.15.0     # the wheel for another release, beside that release's venv's torch

The wheel is the newest in dist/ built for this process's torch. A fresh venv outside the
checkout gets it with ``pip install``, torch with it (or, with ``COMM_TORCH_SITE``, the
torch of that site-packages folder, through a .pth file, so that a release's several GB
are not installed twice); pip's ninja is then removed, ``PATH`` holds only the venv's
scripts and ``CXX`` is unset, and the build cache is an empty folder. Then make demo's
stories run as written, on the CPU and on two simulated NPUs, and nothing is compiled.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def the_wheel() -> Path:
    local = torch.__version__.replace("+", ".")
    found = sorted((ROOT / "dist").glob(f"torch_comm_shim-*+torch{local}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        pytest.fail(f"no wheel for torch {torch.__version__} in dist/: run make wheel first")
    return found[-1]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """(the fresh venv's python, the environment a user without a compiler runs it in)."""
    home = tmp_path_factory.mktemp("user")
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    torch_site = os.environ.get("COMM_TORCH_SITE")
    if torch_site:
        (site / "torch-of-the-release.pth").write_text(torch_site + "\n")
    # As the Makefile's venvs do: this file replaces any constraint pip's configuration names (a machine may cap
    # torch's release below the one the wheel pins).
    constraints = home / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", str(the_wheel())],
                             capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PIP_CONSTRAINT": str(constraints)})
    assert install.returncode == 0, install.stderr
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "ninja"], check=True)
    env = {key: value for key, value in os.environ.items() if key not in ("CXX", "CC", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=str(venv / "bin"), TORCH_EXTENSIONS_DIR=str(home / "empty-build-cache"),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return python, env, home


def run(user, *args):
    python, env, home = user
    return subprocess.run([str(python), *map(str, args)], capture_output=True, text=True, env=env, cwd=home,
                          timeout=600)


def test_the_user_has_no_compiler_and_no_ninja_and_comm_stages(user):
    python, env, home = user
    assert not any(shutil.which(tool, path=env["PATH"]) for tool in ("c++", "g++", "gcc", "cc", "ninja"))
    check = run(user, "-c", "import comm, comm.testing, comm._native as n; "
                "print(comm.__file__, comm.unavailable_reason(), comm.testing.can_simulate(), "
                "n.STAGING.prebuilt() is not None, n.SIMULATED.prebuilt() is not None)")
    assert check.returncode == 0, check.stderr
    location, reason, simulate, *prebuilt = check.stdout.split()
    assert str(ROOT) not in location and "site-packages" in location
    assert (reason, simulate, prebuilt) == ("None", "True", ["True", "True"])


@pytest.mark.parametrize("story", [
    ["examples/bind_and_reduce.py"],
    ["examples/bind_and_reduce.py", "--simulate", "npu"],
    ["examples/fsdp2_offload_clip.py"],
    ["-m", "comm", "examples/full_state_dict.py", "--simulate", "npu"],
    ["-m", "comm", "--simulate", "npu", "examples/cuda_trainer.py"],
], ids=["bind-cpu", "bind-npu", "fsdp2-offload-clip", "full-state-dict", "cuda-trainer"])
def test_make_demos_stories_run_from_the_wheel_and_compile_nothing(user, story):
    python, env, home = user
    arguments = [str(ROOT / part) if part.startswith("examples/") else part for part in story]
    result = run(user, *TORCHRUN, *arguments)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert not (home / "empty-build-cache").exists() or not any((home / "empty-build-cache").iterdir())
