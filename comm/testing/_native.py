"""Build, once per machine, and load the simulated device's C++ core (``csrc/``).

It is compiled on first use with ``torch.utils.cpp_extension`` into a cache folder
named for a hash of its sources, this torch and this Python, so a changed source or
another torch gets a build of its own and every later process just imports it.
The folder is under ``$TORCH_EXTENSIONS_DIR`` when set, else under the user's
cache (``$XDG_CACHE_HOME`` or ``~/.cache``). Concurrent first builds (pytest
workers, rank processes) wait for each other on torch's lock in that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional, Tuple

import torch

_SOURCES = ("device.cpp", "backend.cpp")
_HEADERS = ("simulated.h",)
_CSRC = Path(__file__).with_name("csrc")
# The C++ is written against torch 2.13's headers; older releases lack parts of the
# PrivateUse1 and c10d interfaces it implements.
_OLDEST_TORCH = (2, 13)

_LOCK = threading.Lock()
_MODULE: Optional[ModuleType] = None


def unavailable_reason() -> Optional[str]:
    """Why this process cannot build the simulated device, or None when it can."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < _OLDEST_TORCH:
        return f"the simulated accelerator's C++ core needs torch >= 2.13; this is torch {torch.__version__}"
    if not torch.distributed.is_available():
        return "this torch is built without torch.distributed"
    if is_built():
        return None  # what follows is needed to build it
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler to build the simulated accelerator: {compiler!r} is not on PATH (set CXX)"
    if not cpp_extension.is_ninja_available():
        return "torch.utils.cpp_extension needs ninja to build the simulated accelerator; it is not on PATH"
    if not (Path(cpp_extension.include_paths()[0]) / "torch" / "extension.h").exists():
        return "this torch ships no C++ headers (torch/include) to build the simulated accelerator against"
    return None


def load() -> ModuleType:
    """The compiled core, built first if this machine has no build of these sources yet.

    Loading it registers the device guard, allocator and kernels for PrivateUse1.
    """
    global _MODULE
    with _LOCK:
        if _MODULE is None:
            reason = unavailable_reason()
            if reason is not None:
                raise RuntimeError(reason)
            _MODULE = _import_or_build()
        return _MODULE


def is_built() -> bool:
    """Whether this machine has a finished build of these sources for this torch."""
    directory, library = _build_paths()
    return library.exists() and not (directory / "lock").exists()


def _build_paths() -> Tuple[Path, Path]:
    name = f"comm_simulated_{_fingerprint()}"
    directory = _cache_root() / name
    return directory, directory / f"{name}.so"


def _import_or_build() -> ModuleType:
    directory, library = _build_paths()
    if is_built():
        spec = importlib.util.spec_from_file_location(library.stem, library)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot import the simulated accelerator's build at {library}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    built: ModuleType = cpp_extension.load(
        library.stem,
        [str(_CSRC / source) for source in _SOURCES],
        extra_cflags=["-O2"],
        extra_include_paths=[str(_CSRC)],
        build_directory=str(directory),
        verbose=False,
    )
    return built


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update((_CSRC / source).read_bytes())
    digest.update(f"{torch.__version__} {sys.version} {platform.machine()}".encode())
    return digest.hexdigest()[:16]


def _cache_root() -> Path:
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "comm"
