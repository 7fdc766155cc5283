"""The simulated device as torch sees it: PrivateUse1 renamed, and its ``torch.<name>`` module.

The device itself (guard, allocator, hooks, kernels) is C++, in ``csrc/device.cpp``;
this module installs it and gives it the Python module a real accelerator plugin
installs (``torch.npu`` for Ascend), on which torch's FSDP2 and DeviceMesh call
``device_count``, ``set_device``, ``Stream``, ``Event``, ``current_stream``, ...
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.backend_registration import generate_methods_for_privateuse1_backend, rename_privateuse1_backend

from comm._native import SIMULATED

_NAME: Optional[str] = None


def _core() -> Any:
    if _NAME is None:
        raise RuntimeError("the simulated accelerator is not set up; call comm.testing.simulate_accelerator()")
    return SIMULATED.load()


def counters() -> Dict[str, int]:
    """Host<->device transfers and collectives issued on the simulated device so far."""
    result: Dict[str, int] = _core().counters()
    return result


def reset_counters() -> None:
    _core().reset_counters()


FAILURE_MODES = ("raise", "fail_wait")


def fail_next(mode: str, calls: int = 1) -> None:
    """Make the next ``calls`` collectives of the simulated backend fail, as a broken link does.

    ``mode`` is ``"raise"`` (the call raises ``injected backend failure (on call N)``
    when issued) or ``"fail_wait"`` (its work's ``wait()`` and future raise
    ``injected backend failure (on wait)``). Calls are counted across every simulated
    backend of the process, comm's staging communicators included; ``calls=0`` ends
    the failures.
    """
    if mode not in FAILURE_MODES:
        raise ValueError(f"mode must be one of {FAILURE_MODES}, got {mode!r}")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
        raise ValueError(f"calls must be a non-negative int, got {calls!r}")
    _core().fail_next(mode == "fail_wait", calls)


def install_device(name: str, device_count: int) -> None:
    """Load the C++ device, rename PrivateUse1 to ``name`` and install ``torch.<name>``."""
    global _NAME
    core = SIMULATED.load()
    rename_privateuse1_backend(name)
    core.install(device_count)
    core.run_on_host_for(_structured_operators())
    generate_methods_for_privateuse1_backend()
    torch._register_device_module(name, _build_device_module(name, core))  # type: ignore[no-untyped-call]
    _NAME = name


def _structured_operators() -> List[str]:
    """aten operators whose PrivateUse1 kernel would otherwise be a composite over their out= variant."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return [
        name[len("aten::"):]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and has_kernel(name, "CompositeExplicitAutogradNonFunctional")
        and has_kernel(name, "CPU")
    ]


def _index_of(device: Any, core: Any) -> int:
    if device is None:
        return int(core.current_device())
    if isinstance(device, (torch.device, str)):
        index = torch.device(device).index
        return int(core.current_device()) if index is None else index
    return int(device)


def _build_device_module(name: str, core: Any) -> types.ModuleType:
    """The ``torch.<name>`` module a real accelerator plugin would install."""

    class DeviceContext:
        """``torch.<name>.device(index)``: make ``index`` current inside a ``with`` block."""

        def __init__(self, device: Any) -> None:
            self.index = _index_of(device, core)
            self.previous = 0

        def __enter__(self) -> None:
            self.previous = core.current_device()
            core.set_device(self.index)

        def __exit__(self, *exc: Any) -> None:
            core.set_device(self.previous)

    @contextlib.contextmanager
    def stream(chosen: Optional[torch.Stream]) -> Iterator[None]:
        if chosen is None:
            yield
            return
        previous = torch.accelerator.current_stream(chosen.device)
        torch.accelerator.set_stream(chosen)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    module = types.ModuleType(f"torch.{name}", f"Simulated {name} accelerator (comm.testing).")
    functions = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "device_count": core.device_count,
        "current_device": core.current_device,
        "set_device": lambda device: core.set_device(_index_of(device, core)),
        "device": DeviceContext,
        "synchronize": lambda device=None: None,  # every operator completes before it returns
        "empty_cache": lambda: core.empty_cache(core.current_device()),
        "memory_reserved": lambda device=None: core.memory_reserved(_index_of(device, core)),
        # Random operators on the device draw from the CPU generator, which torch.manual_seed seeds.
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "Stream": lambda device=None, priority=0: torch.Stream(
            device=torch.device(name, _index_of(device, core)), priority=priority
        ),
        "Event": lambda enable_timing=False, blocking=False, interprocess=False: torch.Event(
            device=torch.device(name, core.current_device()), enable_timing=enable_timing
        ),
        "current_stream": lambda device=None: torch.accelerator.current_stream(_index_of(device, core)),
        "stream": stream,
    }
    for attr, value in functions.items():
        setattr(module, attr, value)
    return module
