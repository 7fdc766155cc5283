"""What the simulated device's ``torch.<name>`` module offers beyond the basics, shaped as torch_npu's ``torch.npu``.

Frameworks read these before any collective runs: DeepSpeed's NPU accelerator (tensor
types, ``default_generators``, ``memory_stats``), Accelerate (``amp.GradScaler``),
Lightning (``get_rng_state_all``). Each mirrors the torch_npu source named beside it (Ascend/pytorch, master).
"""

from __future__ import annotations

import functools
import os
import re
import types
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["amp_module", "event_class", "get_device_capability", "memory_stats", "mstx", "stream_class",
           "tensor_types"]

def get_device_capability(device: Any = None) -> Optional[Tuple[int, int]]:
    """torch_npu's answer (torch_npu/npu/__init__.py ``get_device_capability``): None, with a warning.

    CANN has no capability; torch_npu returns ``(major, minor)`` only from
    ``TORCH_NPU_DEVICE_CAPABILITY="major.minor"`` and warns that it is for
    compatibility only.
    """
    configured = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY", "")
    found = re.fullmatch(r"(\d+)\.(\d+)", configured)
    warnings.warn("The return value of get_device_capability is only for compatibility with PyTorch and does not "
                  "represent the actual capability of the NPU device.", stacklevel=2)
    return (int(found.group(1)), int(found.group(2))) if found else None


def memory_stats(figures: Dict[str, int]) -> Dict[str, int]:
    """``memory_stats()`` in the flat ``"family.pool.stat"`` form of torch_npu/npu/memory.py (as CUDA's).

    From the simulation's caching allocator (``figures``: allocated and reserved bytes now
    and at their peak), all in the large pool; what it does not count (blocks freed,
    requested as against rounded sizes) reads as the nearest figure it has.
    """
    stats = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0, "num_device_alloc": 0,
             "num_device_free": 0}
    families = {"allocated_bytes": "allocated", "reserved_bytes": "reserved", "active_bytes": "allocated",
                "requested_bytes": "allocated"}
    for family, figure in families.items():
        current, peak = figures[figure], figures[f"peak_{figure}"]
        for pool, (now, most) in (("all", (current, peak)), ("large_pool", (current, peak)), ("small_pool", (0, 0))):
            stats[f"{family}.{pool}.current"] = now
            stats[f"{family}.{pool}.peak"] = most
            stats[f"{family}.{pool}.allocated"] = most
            stats[f"{family}.{pool}.freed"] = most - now
    return dict(sorted(stats.items()))


class _TensorType(type):
    """The type of ``torch.<name>.FloatTensor`` and the others: a legacy tensor type of the device.

    As torch_npu's (torch_npu/csrc/utils/TensorType.cpp, like torch's CUDA types):
    ``isinstance`` is true for a tensor of that dtype on the device, and calling the type
    makes one (from sizes or data, as ``torch.FloatTensor(...)`` does) on the current device.
    """

    dtype: torch.dtype
    device_type: str
    cpu_type: Callable[..., torch.Tensor]

    def __instancecheck__(cls, instance: Any) -> bool:
        return (isinstance(instance, torch.Tensor) and instance.device.type == cls.device_type
                and instance.dtype == cls.dtype)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        return cls.cpu_type(*args, **kwargs).to(cls.device_type)


# torch_npu/npu/__init__.py's __all__ lists these ten.
_TENSOR_TYPES = ("Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short", "BFloat16")


def tensor_types(device_type: str) -> Dict[str, type]:
    """``FloatTensor`` and the other legacy tensor types of ``device_type``."""
    made: Dict[str, type] = {}
    for kind in _TENSOR_TYPES:
        cpu_type = getattr(torch, f"{kind}Tensor")
        made[f"{kind}Tensor"] = _TensorType(f"{kind}Tensor", (), {
            "dtype": cpu_type.dtype, "device_type": device_type, "cpu_type": cpu_type,
            "__module__": f"torch.{device_type}"})
    return made


def amp_module(device_type: str) -> types.ModuleType:
    """``torch.<name>.amp``: ``GradScaler``, ``autocast`` and ``custom_fwd``/``custom_bwd`` of the device.

    torch_npu/npu/amp: a ``GradScaler`` with torch's arguments plus ``dynamic`` (the
    simulation scales dynamically always), an ``autocast`` of ``device_type="npu"``.
    """
    module = types.ModuleType(f"torch.{device_type}.amp", f"Automatic mixed precision on {device_type}.")

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                     growth_interval: int = 2000, dynamic: bool = True, enabled: bool = True) -> None:
            super().__init__(device_type, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    class autocast(torch.amp.autocast):  # noqa: N801  (torch's own name)
        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> None:
            super().__init__(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)

    def custom_fwd(*args: Any, **kwargs: Any) -> Any:
        return torch.amp.custom_fwd(*args, device_type=device_type, **kwargs)

    def custom_bwd(*args: Any, **kwargs: Any) -> Any:
        return torch.amp.custom_bwd(*args, device_type=device_type, **kwargs)

    for value in (GradScaler, autocast, custom_fwd, custom_bwd):
        value.__module__ = module.__name__
        setattr(module, value.__name__, value)
    return module


def stream_class(device_type: str, index_of: Callable[[Any], int]) -> type:
    """``torch.<name>.Stream``: a class, as torch_npu/npu/streams.py's, over torch's generic stream."""

    class Stream(torch.Stream):
        def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
            return super().__new__(cls, device=torch.device(device_type, index_of(device)), priority=priority)

    Stream.__module__ = f"torch.{device_type}"
    return Stream


class _EventType(type):
    """The type of ``torch.<name>.Event``: its instances are torch's events on the device."""

    device_type: str

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch.Event) and instance.device.type == cls.device_type


def event_class(device_type: str, current: Callable[[], int]) -> type:
    """``torch.<name>.Event``: a class, as torch_npu/npu/streams.py's, whose instances are torch's generic events.

    Not a subclass of ``torch.Event``: its ``elapsed_time`` accepts only torch's exact type.
    """

    def make(cls: type, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Any:
        return torch.Event(device=torch.device(device_type, current()), enable_timing=enable_timing,
                           blocking=blocking, interprocess=interprocess)

    return _EventType("Event", (), {"device_type": device_type, "__new__": make, "__module__": f"torch.{device_type}"})


class mstx:  # noqa: N801  (torch_npu's name)
    """``torch.<name>.mstx``: Ascend's profiling markers (MSTX), which mark nothing here.

    As torch_npu/npu/mstx.py's class of static methods, which torch_npu/npu/__init__.py
    puts at ``torch_npu.npu.mstx`` (``from .mstx import mstx``): ``mark``, ``range_start``
    (a range's id; 0 with a warning for an empty message, as there), ``range_end`` and the
    decorator ``mstx_range``, each taking the ``domain`` that torch_npu's later releases
    add. Frameworks import it where torch_npu is present (verl's
    ``verl/utils/profiler/mstx_profile.py``) and call it only while profiling, which the
    simulated device has no profiler for.
    """

    _last_range = 0

    @staticmethod
    def mark(message: str = "", stream: Any = None, domain: str = "default") -> None:
        """A marker at this point: nothing to record without a profiler."""

    @staticmethod
    def range_start(message: str = "", stream: Any = None, domain: str = "default") -> int:
        """The id of a range that starts here (not 0), or 0 with a warning where ``message`` is empty."""
        if not message:
            warnings.warn("Invalid message for mstx.range_start func. Please input valid message string.",
                          stacklevel=2)
            return 0
        mstx._last_range += 1
        return mstx._last_range

    @staticmethod
    def range_end(range_id: int, domain: str = "default") -> None:
        """The end of the range ``range_start`` returned."""

    @staticmethod
    def mstx_range(message: str, stream: Any = None, domain: str = "default") -> Callable[[Callable[..., Any]],
                                                                                            Callable[..., Any]]:
        """A decorator that runs its function inside a range named ``message``."""
        def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(function)
            def ranged(*args: Any, **kwargs: Any) -> Any:
                range_id = mstx.range_start(message, stream, domain)
                try:
                    return function(*args, **kwargs)
                finally:
                    mstx.range_end(range_id, domain)
            return ranged
        return decorate
