"""Argument checks shared by the collectives and point-to-point calls, and comm's environment switches.

Every check names the argument and the form expected, and runs before any tensor
is touched: a caller who passes something wrong learns it from comm, not from a
backend half way through a collective. An environment switch (``COMM_PATCH``,
``COMM_PROFILE``) it does not understand is refused the same way, at import.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from comm.backend import _GroupInfo, _resolve_group


def member_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group to use, or None when this rank is not a member (torch then returns without communicating)."""
    if group is not None and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return _resolve_group(group)


def device_type(tensor: torch.Tensor) -> str:
    """``tensor.device.type``, without building a ``torch.device`` for CPU and CUDA tensors.

    is_cpu and is_cuda are plain flags; building a torch.device costs enough to
    measurably delay a small collective (see benchmarks/overhead.py).
    """
    if tensor.is_cpu:
        return "cpu"
    if tensor.is_cuda:
        return "cuda"
    return tensor.device.type


def check_tensor(tensor: Any, name: str) -> str:
    """Refuse what is not a tensor with data; return its device type."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    kind = device_type(tensor)
    if kind == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no data; expected a tensor with storage")
    return kind


def check_tensor_list(tensors: Any, name: str, length: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                      numel: Optional[int] = None) -> List[torch.Tensor]:
    """Refuse what is not a list of tensors of ``length``, ``dtype`` and ``numel`` elements each (where given)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(tensors).__name__}")
    if length is not None and len(tensors) != length:
        raise ValueError(f"{name} has {len(tensors)} tensors; expected one per rank of the group ({length})")
    for i, tensor in enumerate(tensors):
        check_tensor(tensor, f"{name}[{i}]")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"{name}[{i}] has dtype {tensor.dtype}; expected {dtype} like the input tensor")
        if numel is not None and tensor.numel() != numel:
            raise ValueError(f"{name}[{i}] has {tensor.numel()} elements; expected {numel} like the input tensor")
    return list(tensors)


def check_sizes(tensor: torch.Tensor, name: str, numel: int, dtype: torch.dtype) -> None:
    """Refuse a tensor whose dtype or element count does not fit the collective."""
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected {dtype}")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel} (group size times the piece size)")


def check_root(info: _GroupInfo, rank: Optional[int], group_rank: Optional[int], name: str) -> Tuple[int, int]:
    """Validate ``src``/``dst`` (a global rank) or ``group_src``/``group_dst``; return (group rank, global rank)."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"pass {name} or group_{name}, not both")
    if rank is None and group_rank is None:
        raise ValueError(f"{name} (a global rank) or group_{name} (a rank in the group) is required")
    label, value = (f"group_{name}", group_rank) if group_rank is not None else (name, rank)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if group_rank is None:
        if value not in info.group_ranks:
            raise ValueError(f"{name}={value} is not a rank of the group; expected one of {list(info.group_ranks)}")
        return info.group_ranks[value], value
    if not 0 <= value < info.size:
        raise ValueError(f"group_{name}={value} is out of range; expected 0 <= group_{name} < {info.size}")
    return value, list(info.group_ranks)[value]


def check_peer(info: _GroupInfo, rank: Optional[int], group_rank: Optional[int], name: str) -> Tuple[int, int]:
    """A point-to-point peer: a root (see :func:`check_root`) that is not this process."""
    peer, peer_global = check_root(info, rank, group_rank, name)
    if peer == info.rank:
        raise ValueError(f"{name}={peer_global} is this process's own rank; expected another rank of the group")
    return peer, peer_global


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_switch(name: str, expected: str, also: Tuple[str, ...] = ()) -> str:
    """Environment variable ``name`` read as "on", "off" (also when unset) or one of ``also``; else refused."""
    value = os.environ.get(name, "")
    mode = value.strip().lower()
    if mode in _ON:
        return "on"
    if mode in _OFF:
        return "off"
    if mode in also:
        return mode
    raise ValueError(f"{name}={value!r} is not understood; expected {expected}")


def given(**kwargs: Any) -> Dict[str, Any]:
    """Only the keyword arguments that were given (older torch lacks group_src/group_dst)."""
    return {key: value for key, value in kwargs.items() if value is not None}
