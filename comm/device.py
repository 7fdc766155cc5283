"""Device binding: which accelerator this process runs on, and which of its devices.

Everything here answers "where does this rank compute?" without naming CUDA: the
same trainer binds to ``cuda:1``, ``npu:1``, ``xpu:1`` or the CPU depending on the
machine it lands on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from types import ModuleType
from typing import Iterator, Optional, Tuple, Union

import torch

from comm.launch import launch_info

__all__ = ["accelerator_type", "bind", "current_device", "device_count", "empty_cache"]

DeviceLike = Union[torch.device, str, int]

# Probe order for releases without ``torch.accelerator`` (torch < 2.6). It is the
# order the reviewed fix in the first seed uses; MPS comes last as it is never
# multi-device.
_PROBE_ORDER = ("cuda", "npu", "xpu", "mps")


def accelerator_type() -> str:
    """Return the device type of this process's accelerator, or ``"cpu"``.

    ``COMM_DEVICE=<type>`` in the environment overrides detection (useful to force
    the CPU on a GPU machine); it must name a device type that is available here.
    """
    override = os.environ.get("COMM_DEVICE", "").strip()
    if override:
        return _checked_override(override)
    if hasattr(torch, "accelerator"):
        # Availability first: current_accelerator() names the accelerator torch was
        # built for, so a CUDA wheel on a CPU-only machine says cuda (torch 2.6 raises).
        if not torch.accelerator.is_available():
            return "cpu"
        accelerator = torch.accelerator.current_accelerator()
        return accelerator.type if accelerator is not None else "cpu"
    return _probe_accelerator()


def _probe_accelerator() -> str:
    """Find the accelerator by asking each device module in turn (torch < 2.6)."""
    for device_type in _PROBE_ORDER:
        if device_type == "npu":
            _import_torch_npu_if_installed()
        if _is_available(device_type):
            return device_type
    privateuse1 = torch._C._get_privateuse1_backend_name()
    if privateuse1 != "privateuseone" and _is_available(privateuse1):
        return privateuse1
    return "cpu"


def _import_torch_npu_if_installed() -> None:
    """``torch.npu`` only exists once ``torch_npu`` is imported."""
    if not hasattr(torch, "npu") and importlib.util.find_spec("torch_npu") is not None:
        importlib.import_module("torch_npu")


def _checked_override(device_type: str) -> str:
    if not device_type.isidentifier() or device_type != device_type.lower():
        raise ValueError(
            f"COMM_DEVICE={device_type!r} is not a bare device type; expected a type "
            "such as 'cpu', 'cuda', 'npu', 'xpu' or 'mps', without an index"
        )
    if device_type == "npu":
        _import_torch_npu_if_installed()
    if not _is_available(device_type):
        raise ValueError(
            f"COMM_DEVICE={device_type!r} names a device type that is not available "
            "in this process; expected 'cpu' or an available accelerator"
        )
    return device_type


def _device_module(device_type: str) -> Optional[ModuleType]:
    """The ``torch.<type>`` module of an accelerator, or None."""
    module = getattr(torch, device_type, None)
    return module if hasattr(module, "is_available") else None


def _is_available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "mps":
        return bool(torch.backends.mps.is_available())
    module = _device_module(device_type)
    return module is not None and bool(module.is_available())


def device_count(device_type: Optional[str] = None) -> int:
    """Number of devices of ``device_type`` (the accelerator by default); 1 for the CPU."""
    device_type = device_type or accelerator_type()
    if device_type in ("cpu", "mps"):
        return 1
    module = _device_module(device_type)
    if module is None or not module.is_available():
        return 0
    return int(module.device_count())


# The device bind() bound, for the whole process: an accelerator's current device is
# per thread, and a collective issued from a logging or checkpoint thread must
# still be staged onto this rank's own device.
_bound: Optional[torch.device] = None


def bound_device() -> Optional[torch.device]:
    """The device :func:`bind` bound this process to, whichever thread asks; None before any bind."""
    return _bound


def bind(local_rank: Optional[int] = None) -> torch.device:
    """Bind this process to the device of ``local_rank`` on its accelerator and return it.

    ``local_rank`` defaults to the local rank of the launcher that started this
    process (:func:`comm.launch_info`: torchrun, srun, mpirun, jsrun), else 0. A
    process that sees exactly one device binds it, index 0, whatever its local rank:
    that is how ``--gpus-per-task=1`` and ``CUDA_VISIBLE_DEVICES`` /
    ``ASCEND_RT_VISIBLE_DEVICES`` give each rank its own device. On a CPU-only
    process this returns ``torch.device("cpu")`` and binds nothing, so the same line
    works on every machine.
    """
    device_type = accelerator_type()
    local_rank, origin = _resolve_local_rank(local_rank)
    if device_type == "cpu":
        return torch.device("cpu")
    index = _device_index(local_rank, device_count(device_type), device_type, origin)
    if device_type == "mps":
        return torch.device("mps")
    global _bound
    _set_device_index(device_type, index)
    _bound = torch.device(device_type, index)
    return _bound


def _resolve_local_rank(local_rank: Optional[int]) -> Tuple[int, str]:
    """The local rank to bind and where it came from, for error messages."""
    if local_rank is None:
        info = launch_info()
        return info.local_rank, f"{info.sources['local_rank']} under launcher {info.launcher!r}"
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank must be a non-negative int, got {local_rank!r}")
    return local_rank, "passed to bind()"


def _device_index(local_rank: int, count: int, device_type: str, origin: str) -> int:
    """The device index of a local rank: the rank itself, or 0 when the process sees one device."""
    if count == 1:
        return 0
    if local_rank >= count:
        raise ValueError(
            f"local_rank {local_rank} is out of range: this process sees {count} {device_type} device(s), "
            f"expected 0 <= local_rank < {count} (local rank {local_rank} from {origin}); start at most "
            f"{count} ranks per node, or give each rank one visible device"
        )
    return local_rank


def _set_device_index(device_type: str, index: int) -> None:
    # Every accelerator module (torch.cuda, torch_npu's torch.npu, torch.xpu and
    # PrivateUse1 plugins) implements set_device; torch.accelerator.set_device_index
    # goes through the C++ device guard, which a Python-only backend cannot provide.
    module = _device_module(device_type)
    if module is not None and hasattr(module, "set_device"):
        module.set_device(index)
    else:
        torch.accelerator.set_device_index(index)


def current_device(device_type: Optional[str] = None) -> torch.device:
    """The device this process is bound to for ``device_type`` (the accelerator by default)."""
    device_type = device_type or accelerator_type()
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "mps":
        return torch.device("mps")
    module = _device_module(device_type)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(device_type, int(module.current_device()))
    return torch.device(device_type, torch.accelerator.current_device_index())


def empty_cache(device: Optional[DeviceLike] = None) -> None:
    """Release cached allocator memory on ``device``'s own accelerator.

    ``device`` defaults to the bound accelerator device. A no-op on the CPU (it has
    no caching allocator), documented rather than silent: the seed's
    ``if device.type == "cuda"`` skipped NPU and XPU without a word.
    """
    target = current_device() if device is None else _as_device(device)
    if target.type in ("cpu", "meta"):
        return
    module = _device_module(target.type)
    if module is None or not hasattr(module, "empty_cache"):
        raise RuntimeError(f"device type {target.type!r} has no empty_cache to call")
    with _on_device(module, target):
        module.empty_cache()


def _as_device(device: DeviceLike) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device(accelerator_type(), device)
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError:
            pass
    raise ValueError(f"device must be a torch.device, a device string or an index, got {device!r}")


@contextlib.contextmanager
def _on_device(module: ModuleType, device: torch.device) -> Iterator[None]:
    """Make ``device`` current while releasing its cache, as the seed's fix does."""
    if device.index is None or not hasattr(module, "device"):
        yield
        return
    with module.device(device.index):
        yield
