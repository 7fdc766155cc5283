"""Build, once per machine, and load comm's C++ extensions.

comm has two: the staging backend (``comm/csrc``, see :mod:`comm.slot`) and the
simulated accelerator's core (``comm/testing/csrc``). Each is compiled on first use
with ``torch.utils.cpp_extension`` into a cache folder named for a hash of its
sources, this torch and this Python, so a changed source or another torch gets a
build of its own and every later process just imports it. The folder is under
``$TORCH_EXTENSIONS_DIR`` when set, else under the user's cache (``$XDG_CACHE_HOME``
or ``~/.cache``). Concurrent first builds (pytest workers, rank processes) wait for
each other on torch's lock in that folder. ``python -m comm.build`` builds both
ahead of time, so that the ranks of a job do not each compile at first use.

A platform wheel (``make wheel``) carries both already built, in ``comm/_prebuilt``,
with a manifest naming the torch release and the sources each was built from; where
they match this process's, that build is loaded and nothing is compiled, so no
compiler or ninja is needed. Anything else falls back to the build at first use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional, Sequence, Tuple

import torch

from comm._releases import TORCH_VERSION

# The oldest torch whose PrivateUse1 and c10d interfaces the C++ builds against; what
# differs from one release to the next is in csrc/torch_releases.h.
OLDEST_TORCH = (2, 9)
# The C++ shared by both extensions: csrc/torch_releases.h.
_SHARED = Path(__file__).with_name("csrc")
# Written into a build's folder once the build has finished: torch's own lock file
# there cannot say so (from torch 2.14 it stays behind after the build).
_FINISHED = "comm-build-finished"
# Where a platform wheel carries its builds, and the manifest that says what each was built from.
PREBUILT = Path(__file__).with_name("_prebuilt")
_MANIFEST = "manifest.json"


class Extension:
    """One C++ extension: its sources, and the build of them this process loaded."""

    def __init__(self, name: str, csrc: Path, sources: Sequence[str], headers: Sequence[Path], what: str,
                 switch: Optional[str] = None) -> None:
        self.name, self.csrc, self.sources, self.headers, self.what = name, csrc, tuple(sources), tuple(headers), what
        self.switch = switch  # an environment variable that turns the extension off when "0"
        self._lock = threading.Lock()
        self._module: Optional[ModuleType] = None
        self._digest: Optional[str] = None  # of the sources, read once: the wheel's manifest and the cache ask it

    def unavailable_reason(self) -> Optional[str]:
        """Why this process cannot build or load the extension, or None when it can."""
        if self.switch is not None and os.environ.get(self.switch, "").strip() == "0":
            return f"{self.what} is turned off ({self.switch}=0)"
        if TORCH_VERSION < OLDEST_TORCH:
            oldest = ".".join(map(str, OLDEST_TORCH))
            return (f"{self.what} needs torch >= {oldest}; this is torch {torch.__version__}: "
                    f"pip install 'torch>={oldest}' (with torch_npu, the torch_npu of the same release)")
        if not torch.distributed.is_available():
            return "this torch is built without torch.distributed"
        if self.is_built():
            return None  # what follows is needed to build it
        # Imported only to build: it takes a while, and on a CUDA wheel without CUDA it warns.
        from torch.utils import cpp_extension

        _put_pips_ninja_on_path()
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            return f"no C++ compiler to build {self.what}: {compiler!r} is not on PATH (set CXX)"
        if not cpp_extension.is_ninja_available():
            return f"torch.utils.cpp_extension needs ninja to build {self.what}; it is not on PATH (pip install ninja)"
        if not (Path(cpp_extension.include_paths()[0]) / "torch" / "extension.h").exists():
            return f"this torch ships no C++ headers (torch/include) to build {self.what} against"
        return None

    def load(self) -> ModuleType:
        """The compiled extension, built first if this machine has no build of these sources yet."""
        with self._lock:
            if self._module is None:
                reason = self.unavailable_reason()
                if reason is not None:
                    raise RuntimeError(reason)
                self._module = self._import_or_build()
            return self._module

    def is_loaded(self) -> bool:
        """Whether this process has loaded the extension (nothing it counts can be non-zero before)."""
        return self._module is not None

    def is_built(self) -> bool:
        """Whether this machine has a finished build of these sources for this torch.

        The build is carried by a platform wheel, or cached from an earlier build here.
        """
        directory, library = self._build_paths()
        return self.prebuilt() is not None or (library.exists() and (directory / _FINISHED).exists())

    def prebuilt(self) -> Optional[Tuple[Path, str]]:
        """The build a platform wheel carries and its module's name; None unless it was built from these sources
        for this torch."""
        library = PREBUILT / f"{self.name}.so"
        try:
            built_from = json.loads((PREBUILT / _MANIFEST).read_text())[self.name]
            matches = (built_from["sources"], built_from["torch"]) == (self._sources_digest(), torch.__version__)
            module = str(built_from["module"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return (library, module) if matches and library.exists() else None

    def _build_paths(self) -> Tuple[Path, Path]:
        name = f"{self.name}_{self._fingerprint()}"
        directory = _cache_root() / name
        return directory, directory / f"{name}.so"

    def _import_or_build(self) -> ModuleType:
        prebuilt = self.prebuilt()
        if prebuilt is not None:
            return self._import(*prebuilt)
        directory, library = self._build_paths()
        if self.is_built():
            return self._import(library, library.stem)
        from torch.utils import cpp_extension  # imported only to build (see unavailable_reason)

        directory.mkdir(parents=True, exist_ok=True)
        built: ModuleType = cpp_extension.load(
            library.stem,
            [str(self.csrc / source) for source in self.sources],
            extra_cflags=["-O2"],
            extra_include_paths=sorted({str(self.csrc), str(_SHARED)}),
            build_directory=str(directory),
            verbose=False,
        )
        (directory / _FINISHED).touch()
        return built

    def _import(self, library: Path, name: str) -> ModuleType:
        """The extension module in ``library``, whose init function is named for ``name``."""
        spec = importlib.util.spec_from_file_location(name, library)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot import the build of {self.what} at {library}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _sources_digest(self) -> str:
        if self._digest is None:
            digest = hashlib.sha256()
            for path in [self.csrc / source for source in self.sources] + list(self.headers):
                digest.update(path.read_bytes())
            self._digest = digest.hexdigest()[:16]
        return self._digest

    def _fingerprint(self) -> str:
        """The cache's name for a build: these sources, this torch, this Python, this machine."""
        key = f"{self._sources_digest()} {torch.__version__} {sys.version} {platform.machine()}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def copy_build_to(self, folder: Path) -> Dict[str, str]:
        """Build (or take the cached build), copy it into ``folder`` as ``<name>.so``; return its manifest entry.

        What a platform wheel carries (setup.py). The module's init function is named
        for the build it was compiled as, so the entry keeps that name for :meth:`prebuilt`.
        """
        self.load()
        prebuilt = self.prebuilt()
        if prebuilt is None:
            library = self._build_paths()[1]
            prebuilt = (library, library.stem)
        library, module = prebuilt
        shutil.copyfile(library, folder / f"{self.name}.so")
        return {"sources": self._sources_digest(), "torch": torch.__version__, "module": module}


def _put_pips_ninja_on_path() -> None:
    """Where ninja came from pip (comm depends on it) but its folder is not on ``PATH`` (a venv's python run by its
    path, not activated), add that folder: torch's build finds ninja on ``PATH`` only."""
    try:
        import ninja
    except ImportError:
        return
    folder = str(getattr(ninja, "BIN_DIR", ""))
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH", ""), folder]))


def _cache_root() -> Path:
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "comm"


STAGING = Extension(
    "comm_staging",
    _SHARED,
    ("calls.cpp", "staging_backend.cpp", "coalescing.cpp", "staged_call.cpp", "staged_work.cpp", "tallies.cpp",
     "mixed_devices.cpp", "module.cpp"),
    (_SHARED / "staging.h", _SHARED / "torch_releases.h"),
    "comm's staging backend",
    switch="COMM_STAGING",
)
SIMULATED = Extension(
    "comm_simulated",
    Path(__file__).parent / "testing" / "csrc",
    ("device.cpp", "backend.cpp", "random.cpp", "autocast.cpp"),
    (Path(__file__).parent / "testing" / "csrc" / "simulated.h", _SHARED / "torch_releases.h"),
    "the simulated accelerator's C++ core",
)
