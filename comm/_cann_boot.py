"""Loads comm's fake CANN into this process before torch is imported, where it was asked for.

torch imports torch_npu as it is imported itself (its device-backend autoload), and torch_npu
needs CANN's libraries at that moment. So the fake (:mod:`comm.testing.cann`) must be in the
process before ``import torch``, which ``import comm`` does: this module, imported first by
``comm/__init__.py``, imports no torch and acts when imported. It acts only when asked: ``COMM_SIMULATE=cann`` in the
environment, or a command line of ``python -m comm.testing.cann`` or ``python -m comm
--simulate cann``. It then builds the fake where this machine has no build of it (in a child
process, where torch_npu is not autoloaded), loads it under CANN's library names, and puts its
folder on ``LD_LIBRARY_PATH`` so that every process started from here loads it too.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

# What the launchers set, so that the processes a script starts ask for the fake too.
SIMULATE = "COMM_SIMULATE"
FAKE = "cann"
# Set in the child that builds the fake: it must not ask for the fake itself.
_BUILDING = "COMM_FAKE_CANN_BUILDING"


def requested(argv: Optional[List[str]] = None) -> bool:
    """Whether this process was asked to run on the fake CANN."""
    if os.environ.get(_BUILDING) == "1":
        return False
    if os.environ.get(SIMULATE, "").strip() == FAKE:
        return True
    args = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    if "-m" not in args:
        return False
    module, rest = args[args.index("-m") + 1:][:1], args[args.index("-m") + 2:]
    if module == ["comm.testing.cann"]:
        return True
    return module == ["comm"] and rest[:2] == ["--simulate", FAKE]


def build_folder() -> Path:
    """The fake's folder, built first (in a child process without torch_npu) if it is not built yet."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **{_BUILDING: "1"})
    env.pop(SIMULATE, None)
    result = subprocess.run([sys.executable, "-c", "from comm.testing.cann import build; print(build())"],
                            env=env, capture_output=True, text=True)
    if result.returncode != 0:  # the compiler's first error, or else the builder's last line (what to install)
        lines = result.stderr.strip().splitlines() or ["no reason given"]
        errors = [line for line in lines if "error:" in line]
        raise SystemExit(f"comm: cannot run on the fake CANN: {(errors or lines)[-1 if not errors else 0]}")
    return Path(result.stdout.strip().splitlines()[-1])


def boot() -> None:
    """Load the fake CANN into this process, and into the processes it starts, where it was asked for."""
    if not requested():
        return
    folder = Path(os.environ["COMM_FAKE_CANN_FOLDER"]) if os.environ.get("COMM_FAKE_CANN_FOLDER") else build_folder()
    os.environ["COMM_FAKE_CANN_FOLDER"] = str(folder)
    os.environ[SIMULATE] = FAKE
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != str(folder)]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(folder), *paths])
    # Loaded by name, each library answers for that name when torch_npu links or opens it.
    for library in sorted(folder.glob("lib*.so")):
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


boot()
