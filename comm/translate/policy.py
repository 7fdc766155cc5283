"""Who sees ``torch.cuda.is_available()`` as True in the drop-in mode, decided once per module.

The user's script and its own modules do, so a trainer takes its CUDA branch, which comm
translates; torch, comm and installed packages see the truth, so a library is not sent
down a path that needs CUDA itself. Device-selection frameworks that then run through
``torch.cuda`` (Lightning's ``accelerator="cuda"``) are the exception, and so are torch's own
test helpers (``torch.testing._internal``) where the process has an accelerator: they then count
its devices. On a CPU-only process they see the truth, so that torch's tests that need a GPU skip
there as they do without comm.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from typing import FrozenSet, Tuple

from comm.translate.core import target_type

# Installed packages that choose the device from is_available() and device_count(), then run on
# it through torch.cuda's functions, init_process_group("nccl") and .to("cuda:N"), which the
# translation translates: Lightning's accelerator="cuda".
DEVICE_SELECTORS = frozenset({"lightning", "lightning_fabric", "pytorch_lightning"})
# torch's test helpers (skip_if_lt_x_gpu, the distributed tests' device choice): selectors where
# the process has an accelerator, whose devices they then count; on the CPU alone a test that
# needs GPUs must skip, as without comm.
TEST_HELPERS = frozenset({"torch.testing._internal"})
_OWN = frozenset({"torch", "comm"})
_INSTALLED = ("site-packages", "dist-packages")


def sees_the_truth(depth: int = 2) -> bool:
    """Whether the function ``depth`` frames up was called by code that must see that there is no CUDA.

    That is torch and comm, and installed packages (code in a site-packages or
    dist-packages folder, or the standard library), other than the device-selection
    frameworks of :data:`DEVICE_SELECTORS`, and torch's test helpers (:data:`TEST_HELPERS`)
    on a process without an accelerator: a library told ``True`` takes paths that
    need CUDA itself (capability checks, Triton kernels, fused optimizers). The user's
    script and its own modules see ``True``.
    """
    frame = sys._getframe(depth)
    kind = _kind_of(str(frame.f_globals.get("__name__", "")), frame.f_code.co_filename)
    return kind == _TRUTH or (kind == _HELPER and target_type() == "cpu")


# What code of a module is told: the truth, what the translation answers, or (torch's test helpers)
# what the translation answers where there is an accelerator.
_TRUTH, _TOLD, _HELPER = "truth", "told", "helper"


@functools.lru_cache(maxsize=4096)
def _kind_of(module: str, filename: str) -> str:
    if _is_in(module, TEST_HELPERS):
        return _HELPER
    if _is_in(module, DEVICE_SELECTORS):
        return _TOLD
    if module.partition(".")[0] in _OWN or _is_installed_code(filename):
        return _TRUTH
    return _TOLD


def _is_in(module: str, packages: FrozenSet[str]) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one (``torch.testing._internal.x``)."""
    parts = module.split(".")
    return any(".".join(parts[:length]) in packages for length in range(1, len(parts) + 1))


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
