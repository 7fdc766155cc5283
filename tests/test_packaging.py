"""The wheel: built from the checkout, installed into fresh virtual environments outside it."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import comm
from comm._jupyter import warn_if_beside_jupyter

pytestmark = pytest.mark.integration  # the integration tier: make test-integration

ROOT = Path(__file__).resolve().parent.parent
# What the build reads: a file the build needs but this list lacks fails the build here.
BUILD_INPUTS = ("pyproject.toml", "setup.cfg", "README.md", "comm")
# Files of the package that the wheel must carry: code, the typing marker, the C++ sources.
PACKAGE_SUFFIXES = {".py", ".typed", ".cpp", ".h"}
# Jupyter's comm, pinned so CI's verdict is reproducible.
JUPYTER_COMM = "comm==0.2.3"
# torch warns at import when numpy is absent, as the Makefile says; nothing else is silenced.
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
       "PYTHONWARNINGS": "ignore:Failed to initialize NumPy"}

REPORT = textwrap.dedent(
    """
    import importlib.metadata, json, os, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import comm, comm.testing
    dist = importlib.metadata.distribution("torch-comm-shim")
    files = [f for f in dist.files if f.parts[0] == "comm" and "__pycache__" not in f.parts]
    print(json.dumps({
        "comm": comm.__file__,
        "testing": comm.testing.__file__,
        "version": comm.__version__,
        "metadata_version": dist.version,
        "files": sorted(f.as_posix() for f in files),
        "missing": [f.as_posix() for f in files if not os.path.isfile(f.locate())],
        "py_typed": os.path.isfile(os.path.join(os.path.dirname(comm.__file__), "py.typed")),
        "clash_warnings": [str(w.message) for w in caught if issubclass(w.category, comm.JupyterCommWarning)],
    }))
    """
)


def _run(*args, cwd, timeout=180):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=ENV, timeout=timeout)


def _pip(*args, cwd):
    result = _run(sys.executable, "-m", "pip", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel `pip wheel` builds from a copy of the checkout's build inputs (no stale build/)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in BUILD_INPUTS:
        source, target = ROOT / name, tmp / "src" / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(exist_ok=True)
            shutil.copy2(source, target)
    _pip("wheel", "--no-deps", "-q", "-w", tmp / "dist", tmp / "src", cwd=tmp)
    (built,) = (tmp / "dist").glob("torch_comm_shim-*.whl")
    return built


def _fresh_venv(path):
    """A new virtual environment with nothing installed; its site-packages sees this torch through a .pth file."""
    _run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent).check_returncode()
    python = path / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=path)
    (Path(site.stdout.strip()) / "torch_site.pth").write_text(f"{Path(torch.__file__).parent.parent}\n")
    return python


def _package_files():
    """The checkout's files the installed package must hold, as paths from the repository root."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "comm").rglob("*")
                  if p.is_file() and p.suffix in PACKAGE_SUFFIXES and "__pycache__" not in p.parts)


def test_wheel_installs_and_imports_outside_the_checkout(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    _pip("--python", python, "install", "--no-deps", "-q", wheel, cwd=tmp_path)

    result = _run(python, "-c", REPORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    site = tmp_path / "venv" / "lib"
    assert Path(report["comm"]).is_relative_to(site) and Path(report["testing"]).is_relative_to(site)
    assert report["version"] == report["metadata_version"] == comm.__version__
    assert report["files"] == _package_files()
    assert report["missing"] == [] and report["py_typed"]
    assert report["clash_warnings"] == []

    usage = _run(python, "-m", "comm", "--help", cwd=tmp_path)
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: python -m comm [--no-devices] script.py")


def test_beside_jupyters_comm_import_warns(wheel, tmp_path):
    downloads = tmp_path / "downloads"
    try:
        got = _run(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--timeout", "30",
                   "--retries", "1", "-q", "-d", downloads, JUPYTER_COMM, cwd=tmp_path, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip(f"downloading Jupyter's {JUPYTER_COMM} took over 120 s")
    if got.returncode != 0:
        pytest.skip(f"could not download Jupyter's {JUPYTER_COMM}: {got.stderr.strip()[-300:]}")
    (jupyter_wheel,) = downloads.glob("comm-*.whl")
    with zipfile.ZipFile(jupyter_wheel) as archive:
        assert {"comm/__init__.py", "comm/base_comm.py"} <= set(archive.namelist())

    python = _fresh_venv(tmp_path / "venv")
    _pip("--python", python, "install", "--no-deps", "-q", jupyter_wheel, cwd=tmp_path)
    _pip("--python", python, "install", "--no-deps", "-q", wheel, cwd=tmp_path)

    result = _run(python, "-c", "import comm; print(comm.all_reduce.__module__)", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["comm.collectives"]
    assert "JupyterCommWarning: torch-comm-shim and Jupyter's comm share the import name 'comm'" in result.stderr
    assert "a dependency of ipykernel" in result.stderr and "replaced its comm/__init__.py" in result.stderr
    assert "own virtual environment" in result.stderr and "pip install --force-reinstall" in result.stderr


def test_jupyters_comm_elsewhere_on_the_path_warns_that_it_is_hidden(tmp_path, monkeypatch):
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "base_comm.py").write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_beside_jupyter()
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(comm.JupyterCommWarning, match="is hidden by this one") as caught:
        warn_if_beside_jupyter()
    assert str(tmp_path / "comm") in str(caught[0].message) and "ipykernel" in str(caught[0].message)
