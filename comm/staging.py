"""Staging: where a tensor must go for a group's backend to accept it.

A collective on a group whose backend does not serve the tensor's device (a CPU
gradient norm on an nccl or hccl group) fails in torch. ``staging_device`` names the
device to move it to; the collective wrappers do the moving.
"""

from __future__ import annotations

from typing import FrozenSet, Optional

import torch
import torch.distributed as dist

from comm.backend import _resolve_group, device_types
from comm.device import _is_available, accelerator_type, current_device

__all__ = ["staging_device"]


def staging_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> Optional[torch.device]:
    """The device ``tensor`` must be staged onto for ``group``, or None if it is served natively.

    The target is the group's bound device (``init_process_group(device_id=...)``)
    if any, else this process's current device of a device type the backend serves
    (the bound local rank), else the CPU for a CPU backend.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    group = _resolve_group(group)
    served = device_types(group)
    if tensor.device.type in served:
        return None
    return _staging_target(group, served)


def _staging_target(group: dist.ProcessGroup, served: FrozenSet[str]) -> torch.device:
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound.type in served:
        return bound
    accelerator = accelerator_type()
    if accelerator in served:
        return current_device(accelerator)
    for device_type in sorted(served - {"cpu"}):
        if _is_available(device_type):
            return current_device(device_type)
    if "cpu" in served:
        return torch.device("cpu")
    raise RuntimeError(
        f"the group's backend serves device types {sorted(served)}, none of which is available in this process"
    )
