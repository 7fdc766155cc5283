"""python -m comm: runs a script or module patched, with its own argv and exit code."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import comm
import comm.__main__ as comm_main

pytestmark = pytest.mark.integration  # the integration tier: make test-integration

REPORT = textwrap.dedent(
    """
    import json, sys
    import comm, torch.nn.utils
    print(json.dumps({
        "argv": sys.argv,
        "name": __name__,
        "collectives": comm.is_patched(),
        "clip replaced": hasattr(torch.nn.utils.clip_grad_norm_, "__comm_replaces__"),
    }))
    sys.exit(3)
    """
)


def _comm(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "comm", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)


def _report(result):
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_script_runs_patched_with_its_argv_and_exit_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(REPORT)
    result = _comm(str(script), "--lr", "1e-3", "extra")
    assert result.returncode == 3, result.stderr
    assert _report(result) == {"argv": [str(script), "--lr", "1e-3", "extra"], "name": "__main__",
                               "collectives": True, "clip replaced": False}
    old_line = _comm("--no-clip", str(script))  # the flag of releases that replaced the clip: still accepted
    assert _report(old_line) == {**_report(result), "argv": [str(script)]}
    assert "--no-clip is no longer needed" in old_line.stderr


def test_module_runs_patched_with_its_argv(tmp_path):
    (tmp_path / "trainer_module.py").write_text(REPORT)
    result = _comm("-m", "trainer_module", "a", "--b", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    report = _report(result)
    assert report["argv"][1:] == ["a", "--b"] and report["argv"][0].endswith("trainer_module.py")
    assert report["name"] == "__main__" and report["collectives"] and not report["clip replaced"]


def test_exceptions_show_the_users_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def user_function():\n    raise ValueError('boom from the user')\n\nuser_function()\n")
    result = _comm(str(script))
    assert result.returncode == 1
    assert f'File "{script}", line 2, in user_function' in result.stderr
    assert "ValueError: boom from the user" in result.stderr


def test_help_and_usage_errors(tmp_path, capsys):
    """In this process: the errors come before anything is patched."""
    comm_main.main(["--help"])
    assert "python -m comm [--no-devices] script.py" in capsys.readouterr().out
    for argv, message in [([], "expected a script or -m module"), (["-m"], "-m needs a module name"),
                          ([str(tmp_path / "absent.py")], "no such file")]:
        with pytest.raises(SystemExit, match=message):
            comm_main.main(argv)
        assert not comm.is_patched()
