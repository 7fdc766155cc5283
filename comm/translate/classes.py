"""``torch.cuda.Stream``, ``torch.cuda.Event`` and ``torch.Generator`` in the drop-in mode: classes
that stand for torch's or the accelerator's own, so that ``isinstance``, subclassing and
annotations such as ``torch.cuda.Stream | None`` work as they do with CUDA.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from comm.translate.core import accelerator_module, note, target_type, translated_device


class _StandsFor(type):
    """The type of a stand-in class: its instances include the accelerator's own objects of that kind.

    ``torch.cuda.Stream()`` on an accelerator returns the accelerator's stream (what its
    functions accept), so ``isinstance(x, torch.cuda.Stream)`` must accept that too, and
    the streams ``current_stream()`` returns. Everything else (``X | None``,
    annotations, subclassing) is an ordinary class's.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        if type.__instancecheck__(cls, instance):
            return True
        kind: str = cls.__dict__.get("_KIND", "")
        if not kind:
            return False
        module = accelerator_module()
        own = getattr(module, kind, None) if module is not None else None
        if isinstance(own, type) and isinstance(instance, own):
            return True
        generic = getattr(torch, kind)  # torch.Stream, torch.Event: what torch.accelerator hands out
        return isinstance(instance, generic) and instance.device.type == target_type()


def _device_of(device: Any) -> torch.device:
    """The device a stream is made on: the given CUDA device translated, else the current device."""
    kind = target_type()
    if device is None:
        return torch.device("cpu") if kind == "cpu" else torch.device(kind, _current_index())
    found = torch.device(translated_device(device))
    if found.type != "cpu" and found.index is None:
        return torch.device(found.type, _current_index())
    return found


def _current_index() -> int:
    """The accelerator's current device index (only asked where there is an accelerator)."""
    module = accelerator_module()
    return int(module.current_device()) if module is not None else 0


class Stream(torch.Stream, metaclass=_StandsFor):
    """``torch.cuda.Stream``: the accelerator's own stream class makes it; on the CPU, torch's CPU stream.

    A subclass (``class MyStream(torch.cuda.Stream)``) gets an instance of itself, a
    ``torch.Stream`` on the same device, since the accelerator's class is not its base.
    """

    _KIND = "Stream"

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        target = _device_of(device)
        module = accelerator_module()
        own = getattr(module, "Stream", None) if module is not None else None
        if cls is Stream and isinstance(own, type):
            note("torch.cuda.Stream", lambda: f"torch.cuda.Stream into torch.{target_type()}.Stream")
            made: Stream = own(target, priority=priority, **kwargs)
            return made
        return super().__new__(cls, device=target, priority=priority)


class Event(metaclass=_StandsFor):
    """``torch.cuda.Event``: the accelerator's own event; on the CPU (torch's CPU backend has none) the host's clock.

    On the CPU work is done when its call returns, so a recorded event has completed,
    and ``elapsed_time`` is the host time between two records, in milliseconds.
    """

    _KIND = "Event"

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                **kwargs: Any) -> "Event":
        module = accelerator_module()
        own = getattr(module, "Event", None) if module is not None else None
        if cls is Event and own is not None:
            note("torch.cuda.Event", lambda: f"torch.cuda.Event into torch.{target_type()}.Event")
            made: Event = own(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
            return made
        return super().__new__(cls)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs: Any) -> None:
        self.enable_timing = enable_timing
        self.recorded: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self.recorded = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        if not self.enable_timing or self.recorded is None or end.recorded is None:
            raise RuntimeError("elapsed_time needs two recorded events created with enable_timing=True")
        return (end.recorded - self.recorded) * 1000.0


# torch's own class, read when this module is imported: before the translation puts the stand-in below in its place.
_TORCH_GENERATOR = torch.Generator


class _AnyGenerator(type(_TORCH_GENERATOR)):  # type: ignore[misc]  # torch's metaclass for its opaque classes
    """The type of the ``torch.Generator`` stand-in: every torch generator is an instance of it."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _TORCH_GENERATOR)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _TORCH_GENERATOR)


class Generator(_TORCH_GENERATOR, metaclass=_AnyGenerator):
    """``torch.Generator(device)``: a CUDA device's becomes the accelerator's generator (or the CPU's).

    ``torch.Generator("cuda")`` raises without CUDA; here it makes torch's own generator
    of the translated device, so ``generator=`` arguments on the accelerator's tensors
    accept it. Any torch generator is an instance of this class, and a subclass
    (``class MyGenerator(torch.Generator)``) gets an instance of itself.
    """

    def __new__(cls, device: Any = "cpu") -> Any:
        target = translated_device(device)
        if target is not device:
            note("torch.Generator", lambda: f"torch.Generator({device!r}) into torch.Generator({target!r})")
        if cls is Generator:
            return _TORCH_GENERATOR(target)
        return _TORCH_GENERATOR.__new__(cls, target)  # type: ignore[call-arg]  # torch's stub omits its arguments
