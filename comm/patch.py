"""Drop-in mode: code that calls torch.distributed itself stages, unchanged.

``comm.patch()`` equips every process group with comm's staging backend
(:mod:`comm.slot`): the groups that exist, and each group c10d creates afterwards
(``init_process_group``, ``new_group``, ``DeviceMesh`` and its subgroups), by
watching the one function c10d creates groups with; groups split from an equipped
group (``split_group``) get comm's backend from its split. It replaces none of
torch's collectives: c10d hands the calls on unserved devices to comm's backend,
and every other call is torch's alone. Unless told not to, it also puts
:func:`comm.clip_grad_norm_` in place of torch's (one collective for all the
gradients, whatever their devices).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch.distributed as dist

from comm import norm, slot, translate
from comm.translate import spawn as translate_spawn

__all__ = ["is_patched", "patch", "patched", "unpatch"]

_LOG = logging.getLogger("comm")
_CLIP_MODULES = ("torch.nn.utils", "torch.nn.utils.clip_grad")
_LOCK = threading.RLock()
# (module name, attribute) -> torch's original object, for each attribute replaced.
_ORIGINALS: Dict[Tuple[str, str], Any] = {}


def patch(clip_grad_norm: bool = True, devices: bool = True) -> None:
    """Equip every process group, now and to come, with comm's staging backend; and replace ``clip_grad_norm_``.

    With ``devices`` (the default), in a process without CUDA, CUDA-only calls act on
    this process's accelerator or the CPU (:mod:`comm.translate`). Idempotent and
    thread-safe. Where comm's backend cannot be built here it says so once and
    stages nothing (comm's explicit calls still stage in Python).
    """
    for name, value in (("clip_grad_norm", clip_grad_norm), ("devices", devices)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    with _LOCK:
        if devices:
            translate.install()
        for module_name, name, replacement in _targets(clip_grad_norm):
            _install(module_name, name, replacement)
        reason = slot.unavailable_reason()
        if reason is not None:
            _LOG.warning("comm.patch() cannot stage: %s", reason)
            return
        for group in slot.existing_groups():
            slot.equip(group)


def unpatch() -> None:
    """Put back torch's exact original objects. Groups already equipped keep comm's backend (c10d cannot drop one)."""
    with _LOCK:
        for (module_name, name), original in list(_ORIGINALS.items()):
            setattr(importlib.import_module(module_name), name, original)
            del _ORIGINALS[(module_name, name)]
        translate.uninstall()


def is_patched() -> bool:
    """Whether comm is currently watching group creation (or replacing ``clip_grad_norm_``)."""
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
            if not translated:
                translate.uninstall()


def _targets(clip_grad_norm: bool) -> List[Tuple[str, str, Callable[..., Any]]]:
    targets: List[Tuple[str, str, Callable[..., Any]]] = []
    if slot.unavailable_reason() is None:
        module_name, name = slot.GROUP_CREATION
        targets.append((module_name, name, _create_group))
    if clip_grad_norm:
        targets += [(m, "clip_grad_norm_", norm.clip_grad_norm_) for m in _CLIP_MODULES]
    targets.append(("multiprocessing.spawn", "get_command_line", translate_spawn.get_command_line))
    return targets


def _create_group(*args: Any, **kwargs: Any) -> Any:
    """c10d's own group creation, then comm's backend in the new group's empty slots.

    A rank outside the new group gets torch's placeholder (``NON_GROUP_MEMBER``)
    rather than a group: nothing to equip there.
    """
    created = _ORIGINALS[slot.GROUP_CREATION](*args, **kwargs)
    group = created[0]  # (the group, its store)
    if isinstance(group, dist.ProcessGroup):
        slot.equip(group)
    return created


def _install(module_name: str, name: str, replacement: Callable[..., Any]) -> None:
    if (module_name, name) in _ORIGINALS:
        return
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    _ORIGINALS[(module_name, name)] = original
    setattr(module, name, _stand_in(original, replacement))


def _stand_in(original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` under ``original``'s name, docstring and signature."""

    @functools.wraps(original)
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    stand_in.__comm_replaces__ = original  # type: ignore[attr-defined]
    return stand_in
