"""comm: torch.distributed collectives that run on whatever accelerator a job has.

How this process was launched (:mod:`comm.launch`), device binding
(:mod:`comm.device`), backend resolution (:mod:`comm.backend`), staging of tensors
onto a device the group's backend serves (:mod:`comm.staging`), the collectives
(:mod:`comm.collectives`, :mod:`comm.exchange`) and point-to-point calls
(:mod:`comm.p2p`) with their fast path (:mod:`comm.fastpath`), gradient norms (:mod:`comm.norm`),
counters (:mod:`comm.observability`), the profiler (:mod:`comm.profiler`) and the drop-in mode
(:mod:`comm.patch`), which also runs CUDA-only calls on this process's accelerator (:mod:`comm.translate`).
"""

from comm import compile as _compile
from comm._jupyter import JupyterCommWarning, warn_if_beside_jupyter
from comm.arguments import env_switch as _env_switch
from comm.backend import default_backend, device_types, init_process_group
from comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    barrier,
    broadcast,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from comm.device import accelerator_type, bind, current_device, empty_cache
from comm.exchange import all_to_all, all_to_all_single, gather, scatter
from comm.launch import LaunchInfo, launch_info
from comm.norm import clip_grad_norm_, total_norm
from comm.observability import reset_stats, stats
from comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from comm.patch import is_patched, patch, patched, unpatch
from comm.profiler import Profile, profile, profile_if_asked
from comm.staging import staging_device

# The one place the version is written: setup.cfg reads it (version = attr: comm.__version__).
__version__ = "0.1.0"

__all__ = [
    "JupyterCommWarning",
    "LaunchInfo",
    "P2POp",
    "Profile",
    "accelerator_type",
    "all_gather",
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
    "current_device",
    "default_backend",
    "device_types",
    "empty_cache",
    "gather",
    "init_process_group",
    "irecv",
    "isend",
    "is_patched",
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
    "staging_device",
    "stats",
    "total_norm",
    "unpatch",
]


def _simulate_if_asked() -> None:
    """``COMM_SIMULATE=npu`` (or ``npu:hccl``) sets up the simulated accelerator at ``import comm``."""
    import os

    if os.environ.get("COMM_SIMULATE", "").strip():
        from comm.testing import simulate_from_environment

        simulate_from_environment()


def _patch_if_asked() -> None:
    """``COMM_PATCH=1`` in the environment patches torch at ``import comm``."""
    if _env_switch("COMM_PATCH", "1 or 0 (true/false, yes/no, on/off)") == "on":
        patch()


warn_if_beside_jupyter()
_compile.install()
_simulate_if_asked()
_patch_if_asked()
profile_if_asked()
