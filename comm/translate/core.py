"""What every part of the drop-in mode's translation asks: where CUDA calls go (the accelerator's
type, or the CPU), a CUDA device as that device, and one log line per kind of translated call.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from comm.device import accelerator_type

log = logging.getLogger("comm.translate")

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
    """Log what a kind of call became, the first time one is translated (callers may check ``NOTED`` first).

    Not while ``torch.compile`` traces the call: a compiled graph cannot log, and the
    call logs once it runs eagerly.
    """
    if kind not in NOTED and not torch.compiler.is_compiling():
        NOTED.add(kind)
        log.info("comm translated %s", message())


def forget_target() -> None:
    """Look the target up again at the next translated call (after the translation is removed)."""
    global _target
    _target = None
    _translations[:] = ["", {}]


def targets_of(owners: List[Any], name: str, make: Callable[[Any], Any]) -> List[Tuple[Any, str, Any]]:
    """``(owner, name, make(original))`` for each owner that has ``name``: one stand-in shared by all."""
    found = [owner for owner in owners if hasattr(owner, name)]
    if not found:
        return []
    stand_in = make(getattr(found[0], name))
    return [(owner, name, stand_in) for owner in found]


def accelerator_module() -> Optional[types.ModuleType]:
    """The accelerator's device module, or None on the CPU."""
    kind = target_type()
    if kind == "cpu":
        return None
    module = getattr(torch, kind, None)
    return module if isinstance(module, types.ModuleType) else None
