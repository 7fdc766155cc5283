"""Drop-in mode: code that calls torch.distributed itself stages, unchanged.

``comm.patch()`` equips every process group with comm's staging backend
(:mod:`comm.slot`): the groups that exist, and each group c10d creates afterwards
(``init_process_group``, ``new_group``, ``DeviceMesh`` and its subgroups), by
wrapping the one function c10d creates groups with, whoever put it there and
whenever (torch_npu puts a copy of its own there, inside ``import torch`` or at a
later ``import torch_npu``: comm wraps that one); groups split from an equipped
group (``split_group``) get comm's backend from its split. It replaces none of
torch's collectives: c10d hands the calls on unserved devices to comm's backend,
and every other call is torch's alone, ``torch.nn.utils.clip_grad_norm_`` included:
its reductions reach comm's backend like any other call, so it answers as it does
without comm (:func:`comm.clip_grad_norm_` is there to call by name). What it
replaces is recorded in comm's one ledger of replacements (:mod:`comm._ledger`),
which :func:`unpatch` restores from.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from typing import Any, Callable, Iterator

import torch.distributed as dist

from comm import _interpreter_exit, _ledger, slot, translate
from comm.translate import spawn as translate_spawn

__all__ = ["is_patched", "patch", "patched", "unpatch"]

_LOG = logging.getLogger("comm")
_LOCK = threading.RLock()
# Who holds the drop-in mode's replacements in comm's ledger (comm._ledger).
_BY = "comm.patch()"


def patch(*, devices: bool = True) -> None:
    """Equip every process group, now and to come, with comm's staging backend.

    With ``devices`` (the default), in a process without CUDA, CUDA-only calls act on
    this process's accelerator or the CPU (:mod:`comm.translate`). Idempotent and
    thread-safe. Where comm's backend cannot be built here it says so once and
    stages nothing (comm's explicit calls still stage in Python).
    """
    if not isinstance(devices, bool):
        raise TypeError(f"devices must be a bool, got {type(devices).__name__}")
    with _LOCK:
        if devices:
            translate.install()
        if slot.unavailable_reason() is None:
            module_name, name = slot.GROUP_CREATION
            # Followed, not just replaced: a plugin that puts its own helper there later
            # (torch_npu imported after comm) gets comm's wrapper in front of it too.
            _ledger.follow(importlib.import_module(module_name), name, _create_group, by=_BY)
        _install("multiprocessing.spawn", "get_command_line", translate_spawn.get_command_line)
        reason = slot.unavailable_reason()
        if reason is not None:
            _LOG.warning("comm.patch() cannot stage: %s", reason)
            return
        groups = slot.existing_groups()
        for group in groups:
            slot.equip(group)
        if groups:
            _interpreter_exit.hand_over_at_exit()


def unpatch() -> None:
    """Put back what comm replaced, where it still holds comm's object. Groups already equipped keep comm's backend.

    Where someone replaced comm's object after comm did (torch_npu imported after
    ``comm.patch()``), theirs stays. c10d cannot drop a backend from a group.
    """
    with _LOCK:
        _ledger.restore(by=_BY)
        translate.uninstall()


def is_patched() -> bool:
    """Whether comm is currently watching group creation."""
    return bool(_ledger.held(_BY))


@contextlib.contextmanager
def patched(*, devices: bool = True) -> Iterator[None]:
    """Patch inside a ``with`` block; nests, and undoes only what it patched itself."""
    with _LOCK:
        before = _ledger.held(_BY)
        translated = translate.is_installed()
        patch(devices=devices)
        added = _ledger.held(_BY) - before
    try:
        yield
    finally:
        with _LOCK:
            _ledger.restore(by=_BY, only=added)  # what unpatch() inside the block restored is gone already
            if not translated:
                translate.uninstall()


def _create_group(helper: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """c10d's group-creation ``helper`` (torch's, or a plugin's copy of it) creates the group; comm then fills
    its empty slots.

    A rank outside the new group gets torch's placeholder (``NON_GROUP_MEMBER``)
    rather than a group: nothing to equip there.
    """
    created = helper(*args, **kwargs)
    group = created[0]  # (the group, its store)
    if isinstance(group, dist.ProcessGroup):
        slot.equip(group)
    _interpreter_exit.hand_over_at_exit()  # c10d's worker threads exist now, member or not
    return created


def _install(module_name: str, name: str, replacement: Callable[..., Any]) -> None:
    module = importlib.import_module(module_name)
    if (id(module), name) not in _ledger.held(_BY):
        _ledger.replace(module, name, _stand_in(getattr(module, name), replacement), by=_BY)


def _stand_in(original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` under ``original``'s name, docstring and signature."""

    @functools.wraps(original)
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    stand_in.__comm_replaces__ = original  # type: ignore[attr-defined]
    return stand_in
