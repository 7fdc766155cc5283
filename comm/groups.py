"""Facts about process groups that the rest of comm asks: which group a call means, which
backend serves which device type on it, whether that backend does ReduceOp.AVG right,
and a cache keyed by group. The bottom of comm's modules: it imports none of them but
the list of release differences.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Dict, FrozenSet, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from comm._releases import TORCH_VERSION

# Device types per backend for torch releases whose Backend.backend_capability lacks
# an entry (it appeared in torch 2.2; plugins fill it only when they pass `devices`).
FALLBACK_CAPABILITY = {
    "gloo": frozenset({"cpu", "cuda"}),
    "nccl": frozenset({"cuda"}),
    "mpi": frozenset({"cpu", "cuda"}),
    "ucc": frozenset({"cpu", "cuda"}),
    "hccl": frozenset({"npu"}),  # torch_npu registers hccl for npu only
    "xccl": frozenset({"xpu"}),
    "ccl": frozenset({"cpu", "xpu"}),  # oneCCL bindings serve both
}


def device_types_of(group: dist.ProcessGroup) -> FrozenSet[str]:
    """The device types ``group`` serves: its registered backends', else its backend config's."""
    types = frozenset(d.type for d in getattr(group, "_device_types", ()))
    if not types:
        types = frozenset(backends_by_device(backend_config(group)))
    if not types:
        raise RuntimeError(f"cannot tell which device types process group {group!r} serves")
    return types


class GroupFacts(NamedTuple):
    """What equipping a group asks of it, asked once at the start (:func:`comm.slot.equip`) and handed down."""

    group: dist.ProcessGroup
    name: Any  # its group name (torch types it GroupName, a str), which c10d reads from its first backend
    backends: Dict[str, str]  # device type -> the name of the backend it was created with
    bound: Optional[torch.device]  # the device it was bound to at creation (``device_id``), if any


def facts_of(group: dist.ProcessGroup) -> GroupFacts:
    """``group``'s facts, as it stands now."""
    return GroupFacts(group, group.group_name, backends_by_device(backend_config(group)),
                      getattr(group, "bound_device_id", None))


def resolve_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``group``, or the default group for None; a clear error where there is none or it is no group."""
    if group is None:
        default = dist.GroupMember.WORLD
        if default is None:
            raise RuntimeError(
                "the default process group is not initialized; call "
                "comm.init_process_group() (or torch.distributed.init_process_group) first"
            )
        return default
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group


def backend_config(group: dist.ProcessGroup) -> str:
    """What ``group`` was created with: ``"cpu:gloo,cuda:nccl"``, ``"hccl"``; empty where torch cannot say."""
    if hasattr(dist, "get_backend_config"):
        try:
            return str(dist.get_backend_config(group))
        except (ValueError, RuntimeError):
            pass
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return ""


def backend_string_device_types(backend: str) -> FrozenSet[str]:
    """Device types of ``"gloo"`` or of a composite ``"cpu:gloo,cuda:nccl"``."""
    return frozenset(backends_by_device(backend))


def backends_by_device(backend: str) -> Dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` from a backend or composite backend string."""
    backends: Dict[str, str] = {}
    for part in str(backend).lower().split(","):
        head, sep, tail = part.strip().partition(":")
        if sep:
            backends[head] = tail  # "cuda:nccl"
        else:
            backends.update(dict.fromkeys(backend_capability(head), head))  # "gloo"
    return backends


# Where native ReduceOp.AVG is missing or wrong, comm runs SUM and divides. Per
# backend: the first torch release whose AVG is right, per kind of collective, or
# None where comm always emulates.
NATIVE_AVG_SINCE: Dict[str, Optional[Dict[str, Tuple[int, int]]]] = {
    # pytorch#149781 added AVG to gloo's allreduce and reduce in 2.8; its
    # reduce_scatter summed silently instead (pytorch#162338); right on 2.13 (tested).
    "gloo": {"all_reduce": (2, 8), "reduce": (2, 8), "reduce_scatter": (2, 13)},
    "hccl": None,  # rejected on some Ascend parts (reported in ditorch)
    "xccl": None,  # rejected or wrong on some Intel GPUs (torch-xpu-ops#3020)
    "ccl": None,  # oneCCL rejects AVG (torch-xpu-ops#2691)
    "mpi": None,  # ProcessGroupMPI maps no AVG op
    "ucc": None,  # not every UCC transport implements AVG
}


def native_avg(group: dist.ProcessGroup, device_type: str, kind: str) -> bool:
    """Whether ``group``'s backend for ``device_type`` does ReduceOp.AVG right for ``kind``."""
    backend = backends_by_device(backend_config(group)).get(device_type, "")
    if backend == "nccl":
        return group.size() > 1  # NCCL's AVG is wrong at world size 1 (pytorch#144045)
    if backend not in NATIVE_AVG_SINCE:
        return True
    since = NATIVE_AVG_SINCE[backend]
    return since is not None and kind in since and TORCH_VERSION >= since[kind]


def backend_capability(backend: str) -> FrozenSet[str]:
    """The device types backend ``backend`` serves, as torch (or its plugin) registered them."""
    capability = getattr(dist.Backend, "backend_capability", {}).get(backend)
    if capability:
        return frozenset(capability)
    return FALLBACK_CAPABILITY.get(backend, frozenset())


class GroupCache:
    """A per-group cache that forgets a group once it is garbage collected.

    Keyed by ``id(group)`` with a weak reference beside the value: a lookup is one
    dict read and one dereference, cheaper than a WeakKeyDictionary, which builds
    a weak reference on every read. Reads take no lock (a dict read is atomic).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: Dict[int, Tuple["weakref.ref[dist.ProcessGroup]", Any]] = {}

    def get(self, group: dist.ProcessGroup) -> Any:
        entry = self._entries.get(id(group))
        if entry is not None and entry[0]() is group:
            return entry[1]
        return None

    def set(self, group: dist.ProcessGroup, value: Any) -> None:
        key = id(group)
        ref = weakref.ref(group, functools.partial(self._forget, key))
        with self._lock:
            self._entries[key] = (ref, value)

    def _forget(self, key: int, _collected: Any = None) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is None:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
