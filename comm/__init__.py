"""comm: torch.distributed collectives that run on whatever accelerator a job has.

How this process was launched (:mod:`comm.launch`), device binding
(:mod:`comm.device`), backend resolution (:mod:`comm.backend`), staging where
torch routes by device (:mod:`comm.slot`, with its C++ backend in ``comm/csrc``,
built by :mod:`comm._native`), the explicit collectives (:mod:`comm.collectives`,
with what they add in :mod:`comm.gaps` and :mod:`comm.python_staging`), gradient norms
(:mod:`comm.norm`), staging figures (:mod:`comm.observability`), the profiler
(:mod:`comm.profiler`) and the drop-in mode (:mod:`comm.patch`), which also runs CUDA-only
calls on this process's accelerator (:mod:`comm.translate`).
"""

import logging as _logging
import os as _os

# Before anything imports torch: loads the fake CANN where it was asked for (comm._cann_boot).
from comm import _cann_boot  # noqa: F401  (imported for that effect)
from comm._env import env_switch as _env_switch
from comm._jupyter import JupyterCommWarning, warn_if_beside_jupyter
from comm.backend import default_backend, device_types, init_process_group
from comm.collectives import (
    P2POp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    send,
)
from comm.device import accelerator_type, bind, current_device, empty_cache
from comm.launch import LaunchInfo, launch_info
from comm.norm import clip_grad_norm_, total_norm
from comm.observability import reset_stats, stats
from comm.patch import is_patched, patch, patched, unpatch
from comm.profiler import Profile, profile, profile_if_asked
from comm.slot import (
    adopt_thread,
    communicators,
    equip,
    set_staging_budget,
    staged_types,
    staging_budget,
    staging_device,
    unavailable_reason,
)

# The one place the version is written: setup.cfg reads it (version = attr: comm.__version__).
__version__ = "0.3.0"

__all__ = [
    "JupyterCommWarning",
    "LaunchInfo",
    "P2POp",
    "Profile",
    "accelerator_type",
    "adopt_thread",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "bind",
    "broadcast",
    "clip_grad_norm_",
    "communicators",
    "current_device",
    "default_backend",
    "device_types",
    "empty_cache",
    "equip",
    "gather",
    "init_process_group",
    "irecv",
    "is_patched",
    "isend",
    "launch_info",
    "patch",
    "patched",
    "profile",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reset_stats",
    "scatter",
    "send",
    "set_staging_budget",
    "staged_types",
    "staging_budget",
    "staging_device",
    "stats",
    "total_norm",
    "unavailable_reason",
    "unpatch",
]


def _say_if_staging_is_unavailable() -> None:
    """One line, at import, where comm's staging backend cannot be built: why, and what to install."""
    reason = unavailable_reason()
    if reason is not None:
        _logging.getLogger("comm").warning("comm cannot stage in c10d: %s; comm's own calls stage in Python", reason)


def _simulate_if_asked() -> None:
    """``COMM_SIMULATE=npu`` (or ``npu:hccl``) sets up the simulated accelerator at ``import comm``."""
    if _os.environ.get("COMM_SIMULATE", "").strip():
        # Test support, imported only where asked for: most processes never simulate.
        from comm.testing import simulate_from_environment

        simulate_from_environment()


def _patch_if_asked() -> None:
    """``COMM_PATCH=1`` in the environment patches torch at ``import comm``."""
    if _env_switch("COMM_PATCH", "1 or 0 (true/false, yes/no, on/off)") == "on":
        patch()


warn_if_beside_jupyter()
_simulate_if_asked()
_say_if_staging_is_unavailable()
_patch_if_asked()
profile_if_asked()
