"""comm: torch.distributed collectives that run on whatever accelerator a job has.

Device binding (:mod:`comm.device`), backend resolution (:mod:`comm.backend`) and
staging of tensors onto a device the group's backend serves (:mod:`comm.staging`).
"""

from comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    broadcast,
    reduce,
    reduce_scatter_tensor,
)
from comm.backend import default_backend, device_types, init_process_group
from comm.device import accelerator_type, bind, current_device, empty_cache
from comm.norm import clip_grad_norm_, total_norm
from comm.staging import staging_device
from comm.stats import reset_stats, stats

__all__ = [
    "accelerator_type",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "clip_grad_norm_",
    "reduce",
    "reduce_scatter_tensor",
    "reset_stats",
    "stats",
    "total_norm",
    "bind",
    "current_device",
    "default_backend",
    "device_types",
    "empty_cache",
    "init_process_group",
    "staging_device",
]
