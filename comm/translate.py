"""Device binding in the drop-in mode: CUDA-only calls act on this process's accelerator.

Code written for CUDA (``torch.cuda.set_device(local_rank)``, ``model.cuda(local_rank)``,
``init_process_group("nccl")``, ``x.to(torch.device("cuda", r))``) fails on a torch
without CUDA. In a process that has no CUDA, decided once at :func:`install` without
initialising CUDA, comm translates those calls where a device or backend is consumed:

* ``torch.cuda`` becomes a stand-in module (:mod:`comm.translate_cuda`) whose
  functions act on the accelerator's own module, or on the CPU where there is none;
* one device-argument translator serves ``Tensor.to``, ``Tensor.cuda`` (and with it
  ``Module.cuda`` and ``Module.to``), every torch factory function that takes
  ``device=`` (found from the operator schemas, not listed by hand), ``pin_memory``,
  DDP's ``device_ids``/``output_device``, ``init_process_group``/``new_group``
  (backend and ``device_id``), ``init_device_mesh``, ``torch.autocast``, the gradient
  scalers and ``torch.load``'s ``map_location`` (:mod:`comm.translate_calls`).

The accelerator is looked up when a call is first translated, not at install (a
plugin may register its device after the patch), and re-checked while it is the CPU.
Each kind of translated call logs one INFO line, once, on the ``comm.translate``
logger. On a machine with CUDA :func:`install` installs nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from comm._env import env_switch
from comm.device import accelerator_type

__all__ = ["cuda_present", "install", "is_installed", "target_type", "translated_device", "uninstall"]

log = logging.getLogger("comm.translate")

_LOCK = threading.RLock()
# Marks an attribute a class only inherited: unpatching deletes it again.
_ABSENT = object()
# (id(owner), attribute) -> (owner, attribute, torch's original or _ABSENT).
_ORIGINALS: Dict[Tuple[int, str], Tuple[Any, str, Any]] = {}
NOTED: Set[str] = set()
_CPU = torch.device("cpu")
# (PrivateUse1's name when looked up, the device type CUDA calls go to).
_target: Optional[Tuple[str, str]] = None
_privateuse1_name: Callable[[], str] = torch._C._get_privateuse1_backend_name
# [the device type translated to, {CUDA device or string: what it became}]: parsing a
# device string costs more than the call it is given to.
_translations: List[Any] = ["", {}]


def cuda_present() -> bool:
    """Whether this process has CUDA, asked without initialising it (so a later fork stays safe).

    A build without CUDA has none. On a CUDA build, NVML's count (which honours
    ``CUDA_VISIBLE_DEVICES``) answers; only where NVML cannot be asked does this fall
    back to ``torch.cuda.is_available()``, which starts the CUDA driver but creates
    no context.
    """
    if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
        return False
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return True
    nvml_count = getattr(torch.cuda, "_device_count_nvml", None)
    count = int(nvml_count()) if nvml_count is not None else -1
    if count >= 0:
        return count > 0
    return bool(torch.cuda.is_available())


def target_type() -> str:
    """The device type CUDA calls become: this process's accelerator, or ``"cpu"``.

    Looked up on first use; an accelerator, once found, is kept, and a CPU answer is
    asked again when PrivateUse1 gets a new owner (a plugin registered after the patch).
    """
    global _target
    cached = _target
    if cached is not None and (cached[1] != "cpu" or cached[0] == _privateuse1_name()):
        return cached[1]
    found = accelerator_type()
    _target = (_privateuse1_name(), found)
    return found


def translated_device(device: Any) -> Any:
    """``device`` with CUDA replaced by this process's accelerator; anything else as given.

    ``"cuda"``, ``"cuda:N"`` and ``torch.device("cuda", N)`` become the accelerator's
    device of the same index (``npu:N``), or the CPU; where there is no accelerator an
    integer device (which torch reads as the accelerator's index) becomes the CPU too.
    A malformed CUDA string gets torch's own error.
    """
    cls = device.__class__
    if cls is str:
        if not device.startswith("cuda"):
            return device
    elif cls is torch.device:
        if device.type != "cuda":
            return device
    elif cls is int:
        return _CPU if target_type() == "cpu" else device
    else:
        return device
    kind = target_type()
    if kind != _translations[0]:
        _translations[:] = [kind, {}]
    cache: Dict[Any, Any] = _translations[1]
    found = cache.get(device)
    if found is None:
        found = cache[device] = _translate(device, kind)
    return found


def _translate(given: Any, kind: str) -> Any:
    """A CUDA device (or string) as the same kind of value on ``kind``: torch parses a string faster than a device."""
    device = torch.device(given)  # torch's own error for a malformed string
    if device.type != "cuda":  # a string such as "cuda_like" that torch parses as another type
        return given
    if kind != "cpu":
        device = torch.device(kind) if device.index is None else torch.device(kind, device.index)
    else:
        device = _CPU
    return str(device) if isinstance(given, str) else device


def translated_type(device_type: Any) -> Any:
    """A device type string: ``"cuda"`` becomes the accelerator's type (``"cpu"`` where there is none)."""
    return target_type() if device_type == "cuda" else device_type


def note(kind: str, message: Callable[[], str]) -> None:
    """Log what a kind of call became, the first time one is translated (callers may check ``NOTED`` first)."""
    if kind not in NOTED:
        NOTED.add(kind)
        log.info("comm translated %s", message())


def install() -> bool:
    """Install the translation where this process has no CUDA; return whether it did.

    ``COMM_TRANSLATE=0`` in the environment (``python -m comm --no-devices``) turns
    it off. Idempotent.
    """
    from comm import translate_calls, translate_cuda

    with _LOCK:
        if _ORIGINALS:
            return True
        asked = os.environ.get("COMM_TRANSLATE", "").strip()  # unset: on
        if (asked and env_switch("COMM_TRANSLATE", "1 or 0 (true/false, yes/no, on/off)") == "off") or cuda_present():
            return False
        for owner, name, replacement in translate_cuda.targets() + translate_calls.targets():
            replace(owner, name, replacement)
        return True


def uninstall() -> None:
    """Put back torch's exact objects. A no-op when nothing is installed."""
    global _target
    from comm import translate_cuda

    with _LOCK:
        for owner, name, original in reversed(list(_ORIGINALS.values())):
            if isinstance(owner, dict):
                owner[name] = original
            elif original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _ORIGINALS.clear()
        translate_cuda.keep_submodules()
        _target = None
        _translations[:] = ["", {}]


def is_installed() -> bool:
    return bool(_ORIGINALS)


def replace(owner: Any, name: str, replacement: Any) -> None:
    """Set ``owner.name`` to ``replacement``, remembering torch's object (or that a class only inherited it)."""
    key = (id(owner), name)
    if key in _ORIGINALS:
        return
    if isinstance(owner, type):
        original = owner.__dict__.get(name, _ABSENT)
    elif isinstance(owner, dict):
        original = owner[name]
    else:
        original = getattr(owner, name)
    _ORIGINALS[key] = (owner, name, original)
    if isinstance(owner, dict):
        owner[name] = replacement
    else:
        setattr(owner, name, replacement)


def targets_of(owners: List[Any], name: str, make: Callable[[Any], Any]) -> List[Tuple[Any, str, Any]]:
    """``(owner, name, make(original))`` for each owner that has ``name``: one stand-in shared by all."""
    found = [owner for owner in owners if hasattr(owner, name)]
    if not found:
        return []
    stand_in = make(getattr(found[0], name))
    return [(owner, name, stand_in) for owner in found]
