"""A fake CANN, so that the real torch_npu wheel runs on a machine without an Ascend device.

torch_npu links CANN's shared libraries (``libascendcl.so``, ``libhccl.so``, ...) and looks
up about two thousand of their functions at run time. This package builds one library that
holds a fake of each function torch_npu calls (``csrc/``: the ACL runtime with asynchronous
streams, HCCL between processes, aclnn operators computed by libtorch's CPU kernels), exports
every other name torch_npu looks up as a stub that fails with its name, and puts it under each
of CANN's library names. A process started with that folder on ``LD_LIBRARY_PATH`` runs
torch_npu's own code: its device runtime, caching allocator, ``ProcessGroupHCCL`` and
watchdog.

    python -m comm.testing.cann script.py        # the script on torch_npu over the fake
    python -m comm --simulate cann script.py     # the same, with comm

The build is cached per machine, torch and torch_npu release (under comm's build cache); it
needs a C++ compiler and ``nm``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import platform
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Set

__all__ = ["CANN_LIBRARIES", "build", "require_torch_npu", "torch_npu_problem"]

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("runtime.cpp", "hccl.cpp", "aclnn.cpp", "aclop.cpp")
_HEADERS = ("fake_cann.h",)

# The names torch_npu links or dlopens CANN's libraries by: each is the one fake library.
# (libcust_opapi.so is left out: where it exists, torch_npu prefers its custom operators.)
CANN_LIBRARIES = (
    "libascendcl.so", "libhccl.so", "libopapi.so", "libnnopbase.so", "libacl_op_compiler.so", "libge_runner.so",
    "libgraph.so", "libacl_tdt_channel.so", "libruntime.so", "libmsprofiler.so", "libms_tools_ext.so",
    "libascend_dump.so", "libfmk_parser.so", "libascend_protobuf.so", "libacl_dvpp.so", "libatb.so", "libhcomm.so",
)
# CANN's functions among the names a torch_npu library leaves undefined or looks up by string.
_CANN_NAME = re.compile(r"^(acl[a-zA-Z]\w*|Msprof\w+|rt[A-Z]\w*|Hccl[A-Z]\w*)$")
# Stubs that would compute something: they fail with their name, never succeed having done nothing.
_MUST_FAIL = re.compile(r"^(aclnn\w+|aclop\w*(Execute|Compile)\w*)$")
_OPERATOR_NAME = re.compile(rb"aclnn[A-Z][A-Za-z0-9_]*")


def torch_npu_problem() -> Optional[str]:
    """Why torch_npu cannot run here on the fake, as one line saying what to install; None when it can.

    Each torch_npu release requires one torch release (torch-npu 2.13.0 requires torch 2.13.0).
    """
    import importlib.metadata

    import torch

    wanted = f"pip install 'torch-npu=={_release(torch.__version__)}.*'"
    try:
        release = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return f"torch_npu is not installed: {wanted} (the torch_npu release that pairs with this torch)"
    if _release(release) != _release(torch.__version__):
        return f"torch_npu {release} does not pair with torch {torch.__version__}: {wanted}"
    return None


def _release(version: str) -> str:
    """A release's major, minor and patch numbers (2.9.0.post9: 2.9.0): what pairs torch_npu with torch."""
    return ".".join(version.split("+")[0].split(".")[:3])


def _torch_npu_libraries() -> List[Path]:
    import importlib.util

    spec = importlib.util.find_spec("torch_npu")
    if spec is None or spec.origin is None:
        raise RuntimeError(torch_npu_problem() or "torch_npu is not importable")
    package = Path(spec.origin).parent
    return sorted(package.glob("lib/*.so")) + sorted(package.glob("_C*.so"))


def _names(command: List[str]) -> Set[str]:
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def _wanted_names(libraries: List[Path]) -> Set[str]:
    """CANN's functions torch_npu links against or looks up by name."""
    wanted: Set[str] = set()
    for library in libraries:
        wanted |= {n for n in _names(["nm", "-D", "--undefined-only", str(library)]) if _CANN_NAME.match(n)}
        wanted |= {m.decode() for m in _OPERATOR_NAME.findall(library.read_bytes())}
    return wanted


def _stubs_source(names: Set[str]) -> str:
    """C for each name: a function that reports it has no body here (aclnn operators) or does nothing."""
    lines = ['extern int fake_cann_missing(const char* name);',
             'extern int fake_cann_ignored(const char* name);']
    for name in sorted(names):
        body = "missing" if _MUST_FAIL.match(name) else "ignored"
        lines.append(f'int {name}(void) {{ return fake_cann_{body}("{name}"); }}')
    return "\n".join(lines) + "\n"


def _fingerprint(libraries: List[Path]) -> str:
    import torch

    digest = hashlib.sha256()
    for path in [_CSRC / s for s in _SOURCES + _HEADERS] + [Path(__file__)]:
        digest.update(path.read_bytes())
    for library in libraries:
        stat = library.stat()
        digest.update(f"{library.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    digest.update(f"{torch.__version__} {sys.version} {platform.machine()}".encode())
    return digest.hexdigest()[:16]


def _compile(source: Path, target: Path, flags: List[str]) -> None:
    compiler = os.environ.get("CXX", "c++")
    language = ["-x", "c"] if source.suffix == ".c" else ["-std=c++17"]
    result = subprocess.run([compiler, *language, "-c", "-fPIC", "-O1", *flags, str(source), "-o", str(target)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the fake CANN failed at {source.name}:\n{result.stderr[-4000:]}")


def build() -> Path:
    """The folder holding the fake under CANN's library names, built first if this machine has no build."""
    import torch
    from torch.utils import cpp_extension

    from comm._native import _cache_root

    libraries = _torch_npu_libraries()
    folder = _cache_root() / f"fake_cann_{_fingerprint(libraries)}"
    done = folder / "built"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks started together build once
        if done.exists():
            return folder
        torch_lib = Path(torch.__file__).parent / "lib"
        flags = [f"-I{p}" for p in cpp_extension.include_paths()] + [
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", f"-I{_CSRC}"]
        objects = [folder / (Path(s).stem + ".o") for s in _SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda pair: _compile(_CSRC / pair[0], pair[1], flags), zip(_SOURCES, objects)))
        defined: Set[str] = set()
        for obj in objects:
            defined |= _names(["nm", "--defined-only", "--extern-only", str(obj)])
        (folder / "stubs.c").write_text(_stubs_source(_wanted_names(libraries) - defined))
        _compile(folder / "stubs.c", folder / "stubs.o", [])
        library = folder / "libfakecann.so"
        compiler = os.environ.get("CXX", "c++")
        subprocess.run([compiler, "-shared", "-o", str(library), "-Wl,-soname,libfakecann.so", *map(str, objects),
                        str(folder / "stubs.o"), f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}",
                        "-lrt", "-pthread"], check=True)
        _name_libraries(folder, library)
        done.touch()
    return folder


def _name_libraries(folder: Path, library: Path) -> None:
    """One empty library per CANN name, with that name as its soname, depending on the fake: loaded
    beforehand, each answers for its name, and found on ``LD_LIBRARY_PATH``, each brings the fake."""
    compiler = os.environ.get("CC", "cc")
    empty = folder / "empty.c"
    empty.write_text("")
    for name in CANN_LIBRARIES:
        subprocess.run([compiler, "-shared", "-o", str(folder / name), str(empty), f"-Wl,-soname,{name}",
                        "-Wl,--no-as-needed", str(library), "-Wl,-rpath,$ORIGIN"], check=True)


def require_torch_npu() -> None:
    """Import torch_npu, on the fake this process loaded; exit with what to install where it cannot run."""
    problem = torch_npu_problem()
    if problem is not None:
        raise SystemExit(f"comm: the fake CANN runs the installed torch_npu: {problem}")
    importlib.import_module("torch_npu")  # torch autoloads it; imported here too where autoload is off
