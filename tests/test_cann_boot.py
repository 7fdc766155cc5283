"""comm._cann_boot: a run on the fake CANN where torch_npu is missing ends with one line saying what to install."""

import subprocess
import sys

import pytest

from multiproc import quiet_env


@pytest.mark.parametrize("launch", [["-m", "comm.testing.cann"], ["-m", "comm", "--simulate", "cann"]],
                         ids=["control", "under_comm"])
def test_without_torch_npu_one_line_says_what_to_install(launch, tmp_path):
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed here")
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    run = subprocess.run([sys.executable, *launch, str(script)], capture_output=True, text=True, env=quiet_env(),
                         timeout=120)
    assert run.returncode != 0 and "ran" not in run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch_npu is not installed: pip install 'torch-npu==" in lines[0], run.stderr
