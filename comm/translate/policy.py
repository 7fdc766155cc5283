"""Who sees ``torch.cuda.is_available()`` as True in the drop-in mode, decided once per module.

The user's script and its own modules do, so a trainer takes its CUDA branch, which comm
translates; torch, comm and installed packages see the truth, so a library is not sent
down a path that needs CUDA itself. Device-selection frameworks that then run through
``torch.cuda`` (Lightning's ``accelerator="cuda"``, torch's own test helpers in
``torch.testing._internal``) are the exception.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from typing import Tuple

# Installed packages (and torch's own test helpers) that choose the device from is_available()
# and device_count(), then run on it through torch.cuda's functions, init_process_group("nccl")
# and .to("cuda:N"), which the translation translates: Lightning's accelerator="cuda";
# torch.testing._internal's skip_if_lt_x_gpu and the distributed tests' device choice.
DEVICE_SELECTORS = frozenset({"lightning", "lightning_fabric", "pytorch_lightning", "torch.testing._internal"})
_OWN = frozenset({"torch", "comm"})
_INSTALLED = ("site-packages", "dist-packages")


def sees_the_truth(depth: int = 2) -> bool:
    """Whether the function ``depth`` frames up was called by code that must see that there is no CUDA.

    That is torch and comm, and installed packages (code in a site-packages or
    dist-packages folder, or the standard library), other than the device-selection
    frameworks and torch's test helpers of :data:`DEVICE_SELECTORS`: a library told ``True`` takes paths that
    need CUDA itself (capability checks, Triton kernels, fused optimizers). The user's
    script and its own modules see ``True``.
    """
    frame = sys._getframe(depth)
    return _truth_for(str(frame.f_globals.get("__name__", "")), frame.f_code.co_filename)


@functools.lru_cache(maxsize=4096)
def _truth_for(module: str, filename: str) -> bool:
    if _is_selector(module):
        return False
    if module.partition(".")[0] in _OWN:
        return True
    return _is_installed_code(filename)


def _is_selector(module: str) -> bool:
    """Whether ``module`` is one of :data:`DEVICE_SELECTORS` or inside one (``torch.testing._internal.x``)."""
    parts = module.split(".")
    return any(".".join(parts[:length]) in DEVICE_SELECTORS for length in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=1)
def _standard_library() -> Tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.realpath(paths[key]) + os.sep for key in ("stdlib", "platstdlib") if key in paths)


def _is_installed_code(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package or the standard library, not to the user's project."""
    if not filename or filename.startswith("<"):  # python -c, exec'd strings, notebooks' cells
        return False
    path = os.path.realpath(filename)
    parts = path.split(os.sep)
    return any(part in _INSTALLED for part in parts) or path.startswith(_standard_library())
