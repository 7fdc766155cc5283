"""The build cache of comm's C++: built once per machine and release, found again without a compiler."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from comm import _native
from comm._native import SIMULATED, STAGING

from multiproc import skip_unless_simulation

# A process with the builds but no compiler stages a CPU tensor on a one-rank hccl group
# and never imports torch's build machinery (which probes for a compiler and, on a CUDA
# wheel without CUDA, warns).
STAGES_WITHOUT_A_COMPILER = textwrap.dedent(
    """
    import sys, tempfile
    import torch, torch.distributed as dist
    import comm, comm.testing
    assert comm.unavailable_reason() is None, comm.unavailable_reason()
    comm.testing.simulate_accelerator("npu", "hccl")
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("hccl", store=store, rank=0, world_size=1, device_id=torch.device("npu:0"))
    assert comm.equip() == {"cpu"}
    tensor = torch.full((3,), 2.0)
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    assert tensor.tolist() == [2.0, 2.0, 2.0], tensor
    assert "torch.utils.cpp_extension" not in sys.modules
    dist.destroy_process_group()
    print("staged")
    """
)


@pytest.mark.integration
def test_a_build_is_found_again_without_a_compiler_whatever_lock_torch_left(tmp_path):
    skip_unless_simulation()
    STAGING.load()
    for extension in (STAGING, SIMULATED):
        directory, _ = extension._build_paths()
        # torch 2.14 and later leave their build lock behind: it must not read as a build in progress.
        (directory / "lock").touch()
    env = {key: value for key, value in os.environ.items() if key not in ("CXX", "CC")}
    env["PATH"] = str(tmp_path)  # no compiler, no ninja
    result = subprocess.run([sys.executable, "-c", STAGES_WITHOUT_A_COMPILER], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "staged"  # gloo of torch 2.9 prints its connections first
    assert "No CUDA runtime" not in result.stderr and "cpp_extension" not in result.stderr


def test_without_a_compiler_and_without_the_build_the_reason_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert not STAGING.is_built()
    assert STAGING.unavailable_reason() == (
        "no C++ compiler to build comm's staging backend: 'c++' is not on PATH (set CXX)")


def test_a_wheels_build_is_taken_only_where_it_was_built_from_these_sources_for_this_torch(tmp_path, monkeypatch):
    """What a platform wheel carries (``comm/_prebuilt``) loads where its manifest matches; else comm builds."""
    monkeypatch.setattr(_native, "PREBUILT", tmp_path)
    entry = STAGING.copy_build_to(tmp_path)
    manifest = tmp_path / "manifest.json"

    def carried(**changed):
        manifest.write_text(json.dumps({STAGING.name: {**entry, **changed}}))
        return STAGING.prebuilt()

    assert carried() == (tmp_path / f"{STAGING.name}.so", entry["module"])
    assert carried(torch="2.9.1+cpu") is None
    assert carried(sources="0" * 16) is None
    assert SIMULATED.prebuilt() is None  # the manifest names only the staging backend
    manifest.write_text("{not json")
    assert STAGING.prebuilt() is None
    manifest.write_text(json.dumps({STAGING.name: entry}))
    (tmp_path / f"{STAGING.name}.so").unlink()
    assert STAGING.prebuilt() is None
