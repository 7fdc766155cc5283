"""The fast path: can torch take a call's tensors as they are?

Every collective asks :func:`fast_group` first. When the group was resolved
before and serves every tensor's device, the collective calls torch directly,
with nothing but this check in between; otherwise it takes the slow path, which
(:func:`slow_path`) counts the call, resolves the group, checks its arguments,
and calls torch or stages.
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Any, Callable, Dict, FrozenSet, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from comm.arguments import device_type, member_group
from comm.backend import _GROUP_INFO, _group_info, _GroupInfo
from comm.observability import count_call

_Tensor = torch.Tensor


def _forget(ref: Any) -> None:
    """Drop the memo when its group is collected: a dead reference must never match ``group=None``."""
    global _last
    if _last[0] is ref:
        _last = _NOTHING


def _no_group() -> object:
    """Stands in for a reference to a group: it names no group, not even a missing default."""
    return _no_group


_Memo = Tuple[Callable[[], object], Optional[_GroupInfo], bool, bool, FrozenSet[str]]
_NOTHING: _Memo = (_no_group, None, False, False, frozenset())
# The last group any call resolved (on any thread), by weak reference, with what it
# serves (the info, and its serves_cpu, serves_cuda and device_types unpacked, as
# reading a NamedTuple's fields costs more). With it, the next call on the same group
# decides its fast path in one function call: on two ranks sharing two cores, every
# 0.1 us spent before a small collective comes back as about 3 us of latency
# (benchmarks/overhead.py). Replaced whole, so a reader never sees half of it.
_last: _Memo = _NOTHING


_ALONE = object()  # fast_group's ``other`` when a call has one tensor: None is a caller's mistake, not "no tensor"


def fast_group(group: Optional[dist.ProcessGroup], tensor: Any, other: Any = _ALONE) -> Optional[_GroupInfo]:
    """What the group serves, if torch can take ``tensor`` (and ``other``) as they are; else None.

    None means "take the slow path": the group is not the memo's (or not yet
    known), an argument is not a plain tensor, or a tensor's device is not served.
    """
    ref, info, cpu, cuda, types = _last
    if ref() is not (_world._default_pg if group is None else group):
        ref, info, cpu, cuda, types = _recall(group)
    if type(tensor) is not _Tensor or not (cpu if tensor.is_cpu else cuda if tensor.is_cuda
                                           else tensor.device.type in types):
        return None
    if other is _ALONE or type(other) is _Tensor and (cpu if other.is_cpu else cuda if other.is_cuda
                                                    else other.device.type in types):
        return info
    return None


def known_group(group: Optional[dist.ProcessGroup]) -> Optional[_GroupInfo]:
    """What the group serves, if comm has resolved it before; else None (take the slow path)."""
    memo = _last
    if memo[0]() is not (_world._default_pg if group is None else group):
        memo = _recall(group)
    return memo[1]


def fast_list(info: _GroupInfo, tensors: Any, numel: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether ``tensors`` is one served plain tensor per rank (of ``numel`` elements of ``dtype``, where given)."""
    if type(tensors) is not list or len(tensors) != info.size:
        return False
    for tensor in tensors:
        if not fast_tensor(info, tensor) or numel is not None and tensor.numel() != numel:
            return False
        if dtype is not None and tensor.dtype != dtype:
            return False
    return True


def fast_tensor(info: _GroupInfo, tensor: Any) -> bool:
    """Whether ``tensor`` is a plain tensor on a device the group serves."""
    return type(tensor) is _Tensor and (info.serves_cpu if tensor.is_cpu else info.serves_cuda if tensor.is_cuda
                                        else tensor.device.type in info.device_types)


def _recall(group: Optional[dist.ProcessGroup]) -> _Memo:
    """A group comm already knows, made the memo; nothing for one it has not resolved yet."""
    pg = _world._default_pg if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        return _NOTHING
    info: Optional[_GroupInfo] = _GROUP_INFO.get(pg)
    return _NOTHING if info is None else _remember(pg, info)


def slow_path(name: str, group: Optional[dist.ProcessGroup], run: Callable[..., Any], *args: Any) -> Any:
    """Take the slow path: count the call, resolve the group (made the memo), then ``run(pg, info, *args)``.

    When this rank is not in the group torch warns and returns None without
    communicating; so does comm, in torch's words, without calling ``run``.
    """
    memo = _last
    if memo[1] is not None and memo[0]() is (_world._default_pg if group is None else group):
        count_call(name)  # the memo's group: resolved, a member, its facts known
        return run(memo[0](), memo[1], *args)
    pg = member_group(group)
    if pg is None:
        world = dist.GroupMember.WORLD
        warnings.warn(f"Running {name} on global rank {-1 if world is None else world.rank()} which does not "
                      "belong to the given group.", stacklevel=3)
        return None
    count_call(name)
    info = _group_info(pg)
    if _last[0]() is not pg:
        _remember(pg, info)
    return run(pg, info, *args)


def _remember(pg: dist.ProcessGroup, info: _GroupInfo) -> _Memo:
    global _last
    _last = (weakref.ref(pg, _forget), info, info.serves_cpu, info.serves_cuda, info.device_types)
    return _last


def namespace(name: str, entries: Dict[str, Any]) -> types.ModuleType:
    """The namespace a wrapper module reads on every call (torch's functions, call counters), holding ``entries``.

    A module object, because Python specializes attribute reads on modules: with
    the cold caches of a real loop, where the process slept on the previous
    collective, that saved 0.24 to 0.64 us per call over a SimpleNamespace (timed
    by hand in the one-rank loop of benchmarks/overhead.py, part 3). Its
    ``__dict__`` also holds a module's ``__name__``, ``__doc__`` and the like.
    """
    holder = types.ModuleType(name)
    holder.__dict__.update(entries)
    return holder


def served(info: _GroupInfo, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the group serves every one of ``tensors`` where it lies."""
    for tensor in tensors:
        if device_type(tensor) not in info.device_types:
            return False
    return True

