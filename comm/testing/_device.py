"""The simulated device as torch sees it: PrivateUse1 renamed, and its ``torch.<name>`` module.

The device itself (guard, allocator, hooks, kernels) is C++, in ``csrc/device.cpp``;
this module installs it and gives it the Python module a real accelerator plugin
installs (``torch.npu`` for Ascend), on which torch's FSDP2 and DeviceMesh call
``device_count``, ``set_device``, ``Stream``, ``Event``, ``current_stream``, ...
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch
from torch.utils.backend_registration import generate_methods_for_privateuse1_backend, rename_privateuse1_backend

from comm._env import env_bytes
from comm._native import SIMULATED
from comm.testing import _device_api

_NAME: Optional[str] = None
# Registrations that must live as long as the process.
_LIBRARIES: List[Any] = []


def _core() -> Any:
    if _NAME is None:
        raise RuntimeError("the simulated accelerator is not set up; call comm.testing.simulate_accelerator()")
    return SIMULATED.load()


def counters() -> Dict[str, int]:
    """Host<->device transfers and collectives issued on the simulated device so far."""
    result: Dict[str, int] = _core().counters()
    return result


def device_counters(device: Any = None) -> Dict[str, int]:
    """What one simulated device (default: the current one) has seen; see docs/simulated-npu.md.

    ``host_syncs``: times the host waited on the device (a blocking copy between the host
    and the device, ``item()``, ``synchronize()`` of the device, a stream or an event,
    a ``wait()`` that blocks: blocking-wait mode, a barrier). ``drains``: those blocking
    copies (and ``item()``) that found a collective queued on the device, which they
    wait for as torch_npu's copy drains the compute stream. ``communicators`` and
    ``communicator_bytes``: the HCCL communicators living on the device and the memory
    they hold (``mem_get_info`` counts it). :func:`reset_counters` zeroes the first two.
    """
    core = _core()
    result: Dict[str, int] = core.device_counters(_index_of(device, core))
    return result


def reset_counters() -> None:
    _core().reset_counters()


# The modes in which the caller sees the failure as an error.
FAILURE_MODES = ("raise", "fail_wait")
# Every mode fail_next takes: "fail_async" fails on the device as HCCL reports it by default.
ALL_FAILURE_MODES = FAILURE_MODES + ("fail_async",)


def fail_next(mode: str, calls: int = 1, after: int = 0) -> None:
    """Make the next ``calls`` collectives of the simulated backend fail, as a broken link does.

    ``after``: how many collectives succeed first (a failure in the middle of a call that
    runs several, such as a chunked all-reduce).

    ``mode``:

    * ``"raise"``: the call raises ``injected backend failure (on call N)`` when issued
      (HCCL's enqueue fails; ``C10D_HCCL_CHECK`` raises at the call).
    * ``"fail_wait"``: the collective fails on the device and its work's ``wait()``
      raises ``injected backend failure (on wait)``, whatever the backend's error model:
      what HCCL does under blocking wait (``TORCH_HCCL_BLOCKING_WAIT=1``). The future
      (complete at enqueue, as WorkHCCL's) does not raise.
    * ``"fail_async"``: the collective fails on the device and is reported as the
      backend's error model says: under blocking wait ``wait()`` raises; by default
      ``wait()`` returns, ``is_success()`` is False and ``exception()`` holds the error
      once the collective has ended, its outputs hold garbage (NaN, or -7), and the
      watchdog ends the process (``HCCL_ASYNC_ERROR_HANDLING=0``: it does not).

    Calls are counted across every simulated backend of the process, comm's staging
    communicators included; ``calls=0`` ends the failures.
    """
    if mode not in ALL_FAILURE_MODES:
        raise ValueError(f"mode must be one of {ALL_FAILURE_MODES}, got {mode!r}")
    for name, value in (("calls", calls), ("after", after)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    _core().fail_next({"raise": 0, "fail_wait": 1, "fail_async": 2}[mode], calls, after)


def install_device(name: str, device_count: int) -> None:
    """Load the C++ device, rename PrivateUse1 to ``name`` and install ``torch.<name>``."""
    global _NAME
    core = SIMULATED.load()
    rename_privateuse1_backend(name)
    core.install(device_count)
    memory = env_bytes("COMM_SIMULATED_MEMORY", 0)
    if memory:
        core.set_capacity(memory)
    core.run_on_host_for(_operators_with_composites())
    generate_methods_for_privateuse1_backend()
    _register_record_stream()
    module = _build_device_module(name, core)
    torch._register_device_module(name, module)  # type: ignore[no-untyped-call]
    sys.modules[module.amp.__name__] = module.amp
    _NAME = name


def _register_record_stream() -> None:
    """A kernel for ``Tensor.record_stream`` on the device, which FSDP and DDP call on their buffers.

    torch_npu's (csrc/aten/ops/StreamAndEventKernelNpu.cpp) tells its caching allocator
    not to reuse the memory before the stream's work is done. The simulated allocator
    frees at once and every operator completes before it returns: nothing to record.
    """
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    library.impl("record_stream", lambda tensor, stream: None, "PrivateUse1")  # type: ignore[no-untyped-call]
    _LIBRARIES.append(library)


_COMPOSITES = ("CompositeExplicitAutogradNonFunctional", "CompositeExplicitAutograd", "CompositeImplicitAutograd")


def _operators_with_composites() -> List[str]:
    """aten operators with a CPU kernel whose PrivateUse1 kernel would otherwise be a composite.

    Structured operators' (add, mul, ...) is a composite over their out= variant
    (CompositeExplicitAutogradNonFunctional); a few others' decomposes them into other
    operators (CompositeExplicitAutograd: native_layer_norm's, native_group_norm's, ...;
    CompositeImplicitAutograd, which a device without a kernel of its own takes before
    autograd: mish_backward's, silu_backward's, native_channel_shuffle's), whose numerics
    differ from the CPU kernel's. The simulated device runs the CPU's, except where it has
    a kernel of its own (copy_, ...); with a kernel there, autograd treats the operator on
    the device as on the CPU, where the implicit composite is not taken either.
    """
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return [
        name[len("aten::"):]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and has_kernel(name, "CPU")
        and any(has_kernel(name, composite) for composite in _COMPOSITES)
        and not has_kernel(name, "PrivateUse1")
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
        # torch_npu/npu/__init__.py's flag (True after _lazy_init), which activation checkpointing
        # reads before it saves the device's RNG state for the replay: set from the start here.
        "_initialized": True,
        "_is_in_bad_fork": lambda: False,
        "device_count": core.device_count,
        "current_device": core.current_device,
        "set_device": lambda device: core.set_device(_index_of(device, core)),
        "device": DeviceContext,
        # The host waits for what the device was told to wait for (aclrtSynchronizeDevice).
        "synchronize": lambda device=None: core.synchronize(_index_of(device, core)),
        "empty_cache": lambda: core.empty_cache(core.current_device()),
        "memory_allocated": lambda device=None: _memory(core, device)["allocated"],
        "max_memory_allocated": lambda device=None: _memory(core, device)["peak_allocated"],
        "memory_reserved": lambda device=None: _memory(core, device)["reserved"],
        "max_memory_reserved": lambda device=None: _memory(core, device)["peak_reserved"],
        "reset_peak_memory_stats": lambda device=None: core.reset_peak_memory(_index_of(device, core)),
        # Free memory less what HCCL's communicators hold (allocated outside the caching allocator).
        "mem_get_info": lambda device=None: (_free_memory(core, _index_of(device, core)), core.capacity()),
        "get_device_name": lambda device=None: f"simulated {name} (comm.testing)",
        "get_device_properties": lambda device=None: types.SimpleNamespace(
            name=f"simulated {name} (comm.testing)", total_memory=core.capacity(), multi_processor_count=1),
        "is_bf16_supported": lambda including_emulation=True: True,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        "get_device_capability": _device_api.get_device_capability,
        "Stream": _device_api.stream_class(name, lambda device: _index_of(device, core)),
        "Event": _device_api.event_class(name, core.current_device),
        "memory_stats": lambda device=None: _device_api.memory_stats(_memory(core, device)),
        "memory_cached": lambda device=None: _memory(core, device)["reserved"],
        "max_memory_cached": lambda device=None: _memory(core, device)["peak_reserved"],
        "reset_max_memory_allocated": lambda device=None: core.reset_peak_memory(_index_of(device, core)),
        "reset_max_memory_cached": lambda device=None: core.reset_peak_memory(_index_of(device, core)),
        "default_stream": lambda device=None: _default_stream(_index_of(device, core)),
        "_lazy_call": lambda callback, **kwargs: callback(),  # the simulated device is initialised from the start
        # torch_npu's choice between CANN compiling kernels at run time and its prebuilt ones: nothing to choose here.
        "set_compile_mode": lambda jit_compile=True: None,
        "mstx": _device_api.mstx,
        "amp": _device_api.amp_module(name),
        "current_stream": lambda device=None: torch.accelerator.current_stream(_index_of(device, core)),
        "stream": stream,
    }
    functions.update(_device_api.tensor_types(name))
    functions.update(_random_functions(name, core))
    for attr, value in functions.items():
        setattr(module, attr, value)
    return module


def _memory(core: Any, device: Any) -> Dict[str, int]:
    """A device's allocator figures: allocated, reserved, and the peak of each."""
    figures: Dict[str, int] = core.memory(_index_of(device, core))
    return figures


def _free_memory(core: Any, index: int) -> int:
    held: int = core.device_counters(index)["communicator_bytes"]
    return max(0, int(core.capacity()) - int(core.memory(index)["reserved"]) - held)


def pinned_memory(reset_peak: bool = False) -> Dict[str, int]:
    """Pinned host memory the simulation's pinned allocator counts: allocated, reserved and their peaks.

    ``reset_peak``: start both peaks again from now (after reading them).
    """
    core = _core()
    figures: Dict[str, int] = core.memory(-1)
    if reset_peak:
        core.reset_peak_memory(-1)
    return figures


def set_device_memory(nbytes: int) -> None:
    """Give every simulated device ``nbytes`` of memory (16 GiB unless set; ``COMM_SIMULATED_MEMORY`` at start).

    Past it, an allocation first frees the device's cached blocks, then raises torch_npu's
    out-of-memory error (``torch.OutOfMemoryError``: "NPU out of memory. Tried to allocate
    ..."); ``mem_get_info`` and ``get_device_properties`` report it.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive whole number of bytes, got {nbytes!r}")
    _core().set_capacity(nbytes)


def _default_stream(index: int) -> torch.Stream:
    """The device's stream 0, which c10 calls its default stream."""
    current = torch.accelerator.current_stream(index)
    return torch.Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def _random_functions(name: str, core: Any) -> Dict[str, Any]:
    """torch_npu/npu/random.py's functions over ``default_generators``, one ``torch.Generator`` per device.

    Each is the device's default generator (``csrc/random.cpp``): a seed and an offset,
    as torch_npu's NPUGeneratorImpl, whose random operators' numbers the CPU kernels draw.
    """
    generators = tuple(core.default_generator(index) for index in range(int(core.device_count())))

    def generator(device: Any = None) -> torch.Generator:
        found: torch.Generator = generators[_index_of(device, core)]
        return found

    def manual_seed(seed: int) -> None:
        generator().manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        for each in generators:
            each.manual_seed(int(seed))

    def seed() -> None:
        generator().seed()

    def seed_all() -> None:
        manual_seed_all(generators[0].seed())

    def set_rng_state_all(states: Iterable[torch.Tensor]) -> None:
        for each, state in zip(generators, states):
            each.set_state(state)

    return {
        "default_generators": generators,
        "get_rng_state": lambda device=None: generator(device).get_state(),
        "set_rng_state": lambda state, device=None: generator(device).set_state(state),
        "get_rng_state_all": lambda: [each.get_state() for each in generators],
        "set_rng_state_all": set_rng_state_all,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": seed,
        "seed_all": seed_all,
        "initial_seed": lambda: generator().initial_seed(),
    }
