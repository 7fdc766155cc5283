"""The ``torch.cuda`` stand-in of the drop-in mode: CUDA's functions on this process's accelerator.

One module object replaces ``torch.cuda`` (the attribute and ``sys.modules``). The
functions below act on the accelerator's own device module (``torch.npu``,
``torch.xpu``, a PrivateUse1 plugin's), looked up per call; where there is no
accelerator they act on the CPU (documented no-ops where the CPU has nothing to do:
no cache to release, no separate generator to seed). Everything else (``amp``,
``FloatTensor``, private helpers) is torch's own, reached through the stand-in. What
stands for a class is a class (``Stream``, ``Event``, ``device``): ``isinstance``,
subclassing and ``torch.cuda.Stream | None`` work. Capability and property queries
answer as CUDA's do, with values that describe no CUDA architecture where the
accelerator has none.

``is_available`` and ``device_count`` answer by caller: the user's script and its own
modules get the accelerator's answer, so a trainer takes its CUDA branch; torch, comm
and installed libraries get the truth, so they never take a CUDA-only path (except the
device-selection frameworks that then run on the device through ``torch.cuda``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from comm.launch import launch_info
from comm.translate.classes import Event, Stream
from comm.translate.core import accelerator_module, note, target_type, translated_device
from comm.translate.policy import sees_the_truth

__all__ = ["CudaStandIn", "targets"]

_REAL = sys.modules["torch.cuda"]

# torch.cuda's functions that act on one device, and what they return on the CPU.
_ZERO_ON_CPU = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")
_NONE_ON_CPU = ("synchronize", "empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
                "manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all")


def _index(device: Any) -> Optional[int]:
    """The device index a CUDA call names (an int, ``"cuda:N"``, a device), or None for the current one."""
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, (str, torch.device)):
        return torch.device(device).index
    return int(device)


def _forwarded(name: str) -> Callable[..., Any]:
    """``torch.cuda.<name>`` on the accelerator's module of the same name, or its CPU answer."""

    def call(*args: Any, **kwargs: Any) -> Any:
        module = accelerator_module()
        if module is None:
            note(f"torch.cuda.{name}", lambda: f"torch.cuda.{name}() into the CPU's answer (no accelerator)")
            return 0 if name in _ZERO_ON_CPU else _cpu_answer(name, *args)
        if args and name not in ("manual_seed", "manual_seed_all", "set_rng_state", "set_rng_state_all"):
            args = tuple(translated_device(arg) for arg in args)
        if "device" in kwargs:
            kwargs["device"] = translated_device(kwargs["device"])
        target = getattr(module, name, None)
        if target is None:  # torch.accelerator (torch >= 2.6) has the memory statistics too
            target = getattr(getattr(torch, "accelerator", None), name, None)
        if target is None:
            raise AttributeError(f"torch.cuda.{name}: the {target_type()} device module has no {name}")
        note(f"torch.cuda.{name}", lambda: f"torch.cuda.{name} into torch.{target_type()}.{name}")
        return target(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = getattr(_REAL, name, call).__doc__
    return call


def _cpu_answer(name: str, *args: Any) -> Any:
    if name == "get_rng_state":
        return torch.get_rng_state()
    if name == "get_rng_state_all":
        return [torch.get_rng_state()]
    if name == "get_device_name":
        return platform.processor() or platform.machine() or "cpu"
    if name == "mem_get_info":
        return _memory_info()
    if name == "is_bf16_supported":
        return True
    return None


def _memory_info() -> Tuple[int, int]:
    """(free, total) bytes of host memory, for ``mem_get_info`` on the CPU; (0, 0) where the OS cannot say."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name (macOS)
        return 0, 0


def is_available() -> bool:
    """True for the user's code (its CUDA branch is the one comm translates), the truth for libraries.

    Inside ``torch.compile``'s tracing the caller cannot be told (the graph cannot
    inspect frames), so the answer there is torch's own, which sends no code to CUDA.
    """
    if torch.compiler.is_compiling() or sees_the_truth():
        return bool(_REAL.is_available())
    note("torch.cuda.is_available", lambda: f"torch.cuda.is_available() into True (running on {target_type()})")
    return True


def device_count() -> int:
    """The accelerator's device count for the user's code (see :func:`is_available`), the truth for libraries."""
    if torch.compiler.is_compiling() or sees_the_truth():
        return int(_REAL.device_count())
    module = accelerator_module()
    if module is not None:
        return int(module.device_count())
    # On the CPU: one "device" per local rank under a launcher, else one per core.
    info = launch_info()
    return info.local_world_size if info.launcher != "single" else os.cpu_count() or 1


# The index torch.cuda.set_device chose on a CPU-only process (there is no device to bind).
_cpu_index = 0


def set_device(device: Any) -> None:
    global _cpu_index
    index = _index(device)
    module = accelerator_module()
    note("torch.cuda.set_device", lambda: f"torch.cuda.set_device({device!r}) into "
         + (f"torch.{target_type()}.set_device({index})" if module else "nothing (no accelerator: the CPU)"))
    if index is None or index < 0:
        return
    if module is None:
        _cpu_index = index
    else:
        module.set_device(index)


def current_device() -> int:
    module = accelerator_module()
    return _cpu_index if module is None else int(module.current_device())


class device:  # noqa: N801  (torch.cuda.device's own name)
    """``with torch.cuda.device(d):`` makes the accelerator's device ``d`` current (nothing on the CPU)."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device)
        self._context: Any = contextlib.nullcontext()

    def __enter__(self) -> None:
        module = accelerator_module()
        if module is not None and self.index is not None and self.index >= 0:
            note("torch.cuda.device", lambda: f"torch.cuda.device into torch.{target_type()}.device")
            self._context = module.device(self.index)
        self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)


def _nvtx() -> types.ModuleType:
    """``torch.cuda.nvtx``, whose ranges do nothing off CUDA (a CPU build's raise)."""

    @contextlib.contextmanager
    def range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:  # noqa: A001  (nvtx.range's own name)
        yield

    def nothing(*args: Any, **kwargs: Any) -> int:
        return 0

    module = types.ModuleType("torch.cuda.nvtx", "NVTX ranges, which do nothing off CUDA (comm's stand-in).")
    for name, value in {"range": range, "range_push": nothing, "range_pop": nothing, "range_start": nothing,
                        "range_end": nothing, "mark": nothing}.items():
        setattr(module, name, value)
    return module


class CudaStandIn(types.ModuleType):
    """``torch.cuda`` for a process without CUDA; what it does not define is torch's own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_REAL, name)

    def __dir__(self) -> List[str]:
        return sorted(set(dir(_REAL)) | set(self.__dict__))


# Functions forwarded by name to the accelerator's module (or their CPU answer).
_FORWARDED = _ZERO_ON_CPU + _NONE_ON_CPU + (
    "get_rng_state", "get_rng_state_all", "get_device_name", "mem_get_info", "is_bf16_supported",
    "current_stream", "default_stream", "stream", "memory_stats")


# Capabilities CUDA code compares against (``>= (8, 0)``, ``[0] == 10``): no CUDA architecture.
NO_CAPABILITY = (0, 0)


def get_device_capability(device: Any = None) -> Tuple[int, int]:
    """The accelerator's ``(major, minor)`` where it reports one as CUDA does, else ``(0, 0)``.

    CUDA code indexes and compares the answer at import (``get_device_capability()[0] ==
    10``); an accelerator that has no such notion returns None (torch_npu without
    ``TORCH_NPU_DEVICE_CAPABILITY``), a dict (XPU) or raises (torch.accelerator's
    default). ``(0, 0)`` is a capability below every architecture CUDA code checks for,
    so it takes its generic path.
    """
    module = accelerator_module()
    query = getattr(module, "get_device_capability", None) if module is not None else None
    if query is None:
        return NO_CAPABILITY
    try:
        answer = query(translated_device(device))
    except (RuntimeError, NotImplementedError, AssertionError):
        return NO_CAPABILITY
    if isinstance(answer, (tuple, list)) and len(answer) == 2 and all(isinstance(x, int) for x in answer):
        return int(answer[0]), int(answer[1])
    return NO_CAPABILITY


def get_arch_list() -> List[str]:
    """No CUDA architecture: the process translates CUDA calls because it has no CUDA.

    torch's own answer is the architectures the wheel was built for, also where no
    GPU exists (a CUDA wheel from the package index); code that picks kernels by it
    must not pick CUDA ones here.
    """
    return []


class DeviceProperties:
    """``torch.cuda.get_device_properties(d)``: every field CUDA's answer has, from the accelerator where it has it.

    CUDA code reads ``major``/``minor``, ``multi_processor_count``, ``total_memory``,
    ``gcnArchName`` (ROCm checks) and the like; an accelerator's properties carry only
    some (torch_npu's: ``name``, ``total_memory``, core counts). Fields it lacks get
    values that describe no CUDA architecture; anything else is the accelerator's own.
    """

    _DEFAULTS: Dict[str, Any] = {
        "name": "", "major": 0, "minor": 0, "multi_processor_count": 1, "total_memory": 0, "is_integrated": 0,
        "is_multi_gpu_board": 0, "max_threads_per_multi_processor": 0, "gcnArchName": "", "warp_size": 0,
        "uuid": "", "L2_cache_size": 0, "clock_rate": 0, "memory_clock_rate": 0, "memory_bus_width": 0,
        "shared_memory_per_block": 0, "shared_memory_per_multiprocessor": 0,
    }

    def __init__(self, accelerators: Any, **fields: Any) -> None:
        self._accelerators = accelerators
        for name, default in self._DEFAULTS.items():
            setattr(self, name, fields.get(name, getattr(accelerators, name, default)))
        if "capability" in fields:
            self.__dict__["major"], self.__dict__["minor"] = fields["capability"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_accelerators"], name)

    def __repr__(self) -> str:
        return (f"DeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count})")


def get_device_properties(device: Any = None) -> DeviceProperties:
    """The accelerator's properties with CUDA's fields filled in; on the CPU, the host's."""
    module = accelerator_module()
    if module is None:
        return DeviceProperties(None, name=_cpu_answer("get_device_name"), total_memory=_memory_info()[1],
                                multi_processor_count=os.cpu_count() or 1)
    note("torch.cuda.get_device_properties",
         lambda: f"torch.cuda.get_device_properties into torch.{target_type()}.get_device_properties")
    accelerators = module.get_device_properties(translated_device(device))
    return DeviceProperties(accelerators, capability=get_device_capability(device))


def _stream_on_cpu() -> Dict[str, Any]:
    """Streams on the CPU: torch's CPU stream, in whose context nothing changes."""
    return {
        "current_stream": lambda device=None: torch.Stream("cpu"),
        "default_stream": lambda device=None: torch.Stream("cpu"),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "memory_stats": lambda device=None: {},
    }


@functools.lru_cache(maxsize=None)
def stand_in() -> CudaStandIn:
    module = CudaStandIn(_REAL.__name__, _REAL.__doc__)
    for attr in ("__file__", "__path__", "__spec__", "__loader__", "__package__"):
        if attr in _REAL.__dict__:
            setattr(module, attr, _REAL.__dict__[attr])
    cpu = _stream_on_cpu()
    for name in _FORWARDED:
        forwarded = _forwarded(name)
        if name in cpu:
            forwarded = _cpu_or(forwarded, cpu[name])
        setattr(module, name, forwarded)
    for function in (is_available, device_count, set_device, current_device, device, Stream, Event,
                     get_device_capability, get_device_properties, get_arch_list):
        setattr(module, function.__name__, function)
    module.nvtx = _nvtx()  # type: ignore[attr-defined]
    return module


def _cpu_or(forwarded: Callable[..., Any], on_cpu: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forwarded)
    def call(*args: Any, **kwargs: Any) -> Any:
        return forwarded(*args, **kwargs) if accelerator_module() is not None else on_cpu(*args, **kwargs)

    return call


def targets() -> List[Tuple[Any, str, Any]]:
    module = stand_in()
    return [(torch, "cuda", module), (sys.modules, "torch.cuda", module)]


def keep_submodules() -> None:
    """Submodules of torch.cuda imported while the stand-in stood in, given to torch's module too."""
    for name, value in list(stand_in().__dict__.items()):
        if isinstance(value, types.ModuleType) and name not in _REAL.__dict__:
            setattr(_REAL, name, value)
