"""Drop-in mode: comm's behaviour for code that calls torch.distributed itself.

``comm.patch()`` puts comm's collectives (and ``clip_grad_norm_``) in place of
torch's own, in every module torch exposes them from, so an existing trainer or a
library (DeepSpeed, Accelerate, Lightning, torchmetrics) works unchanged when its
tensors are on a device the group's backend does not serve. For DTensor's
functional collectives it registers CPU kernels (:mod:`comm.functional`) while a
group that does not serve the CPU exists; it watches group creation for that.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from comm import collectives, exchange, functional, norm, p2p, translate, translate_spawn

__all__ = ["is_patched", "patch", "patched", "unpatch"]

_COLLECTIVE_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
# The modules whose functions stand in for torch.distributed's (also what the
# profiler times and what torch.compile traces).
WRAPPER_MODULES = (collectives, exchange, p2p)
# Every collective and point-to-point call comm wraps that this torch has. P2POp
# stays torch's: built with the patched isend/irecv it passes torch's own checks.
_WRAPPERS = {
    name: getattr(module, name)
    for module in WRAPPER_MODULES
    for name in module.__all__
    if name != "P2POp" and hasattr(dist, name)
}
_CLIP_MODULES = ("torch.nn.utils", "torch.nn.utils.clip_grad")
# Where c10d creates every group: watched while patched, to register comm's functional
# kernels when a group that does not serve the CPU appears.
_C10D, _CREATE_GROUP = "torch.distributed.distributed_c10d", "_new_process_group_helper"

_LOCK = threading.RLock()
# (module name, attribute) -> torch's original object, for each attribute replaced.
_ORIGINALS: Dict[Tuple[str, str], Any] = {}
# One stand-in per replaced function, the same object in every module: torch
# compares functions by identity (P2POp's op against distributed_c10d.isend).
_STAND_INS: Dict[int, Callable[..., Any]] = {}


def patch(clip_grad_norm: bool = True, devices: bool = True) -> None:
    """Replace torch's collectives (and, unless told not to, ``clip_grad_norm_``) with comm's.

    With ``devices`` (the default), in a process without CUDA, CUDA-only calls act on
    this process's accelerator or the CPU (:mod:`comm.translate`). Idempotent and
    thread-safe. Code that imported a function by name before the patch (``from
    torch.distributed import all_reduce``) keeps torch's original.
    """
    for name, value in (("clip_grad_norm", clip_grad_norm), ("devices", devices)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    with _LOCK:
        if devices:
            translate.install()
        for module_name, name, replacement in _targets(clip_grad_norm):
            _install(module_name, name, replacement)
        if not hasattr(c10d, _CREATE_GROUP) or any(functional.needed(g) for g in list(c10d._world.pg_map)):
            functional.register()  # (without the hook to watch, for every group to come as well)


def unpatch() -> None:
    """Put back torch's exact original objects and remove comm's kernels. A no-op when nothing is patched."""
    with _LOCK:
        for (module_name, name), original in list(_ORIGINALS.items()):
            setattr(importlib.import_module(module_name), name, original)
            del _ORIGINALS[(module_name, name)]
        functional.unregister()
        translate.uninstall()


def is_patched() -> bool:
    """Whether any of torch's functions is currently replaced by comm's."""
    return bool(_ORIGINALS)


@contextlib.contextmanager
def patched(clip_grad_norm: bool = True, devices: bool = True) -> Iterator[None]:
    """Patch inside a ``with`` block; nests, and undoes only what it patched itself."""
    with _LOCK:
        before = set(_ORIGINALS)
        translated = translate.is_installed()
        patch(clip_grad_norm, devices)
        added = set(_ORIGINALS) - before
    try:
        yield
    finally:
        with _LOCK:
            for key in added & set(_ORIGINALS):  # unpatch() inside the block restored the rest
                module_name, name = key
                setattr(importlib.import_module(module_name), name, _ORIGINALS.pop(key))
            if not _ORIGINALS:
                functional.unregister()
            if not translated:
                translate.uninstall()


def _targets(clip_grad_norm: bool) -> List[Tuple[str, str, Callable[..., Any]]]:
    targets = [(m, name, wrapper) for m in _COLLECTIVE_MODULES for name, wrapper in _WRAPPERS.items()]
    if clip_grad_norm:
        targets += [(m, "clip_grad_norm_", norm.clip_grad_norm_) for m in _CLIP_MODULES]
    if hasattr(c10d, _CREATE_GROUP):
        targets.append((_C10D, _CREATE_GROUP, _create_group))
    targets.append(("multiprocessing.spawn", "get_command_line", translate_spawn.get_command_line))
    return targets


def _create_group(*args: Any, **kwargs: Any) -> Any:
    """c10d's own group creation, then comm's functional kernels if the new group needs them.

    A rank outside the new group gets torch's placeholder (``NON_GROUP_MEMBER``)
    rather than a group: nothing to look at there.
    """
    created = _ORIGINALS[(_C10D, _CREATE_GROUP)](*args, **kwargs)
    group = created[0]  # (the group, its store)
    if isinstance(group, dist.ProcessGroup) and functional.needed(group):
        functional.register()
    return created


def _install(module_name: str, name: str, replacement: Callable[..., Any]) -> None:
    if (module_name, name) in _ORIGINALS:
        return
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    _ORIGINALS[(module_name, name)] = original
    stand_in = _STAND_INS.get(id(original))
    if stand_in is None or stand_in.__comm_replaces__ is not original:  # type: ignore[attr-defined]
        stand_in = _STAND_INS[id(original)] = _stand_in(original, replacement)
    setattr(module, name, stand_in)


def _stand_in(original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` under ``original``'s name, docstring and signature."""

    @functools.wraps(original)
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    stand_in.__comm_replaces__ = original  # type: ignore[attr-defined]
    return stand_in
