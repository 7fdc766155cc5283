"""A Python-only accelerator device whose tensors keep a CPU payload.

PrivateUse1 is renamed to the simulated type (say ``npu``). A tensor of that device
is a wrapper subclass holding a CPU tensor; every operator unwraps the payloads,
runs on the CPU and wraps the results that belong on the simulated device. Device
checks follow the real thing: a non-scalar CPU tensor mixed into an operator on
simulated tensors raises, as it does on CUDA or NPU.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Dict, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

# Operators that legitimately take tensors on two devices (copies between them) or
# CPU index tensors (as CUDA allows); every other operator gets the device check.
_CROSS_DEVICE_OPS = frozenset(
    {"copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "to", "lift_fresh", "index", "index_put_", "index_put"}
)
# Copies that move data between the host and the simulated device when their
# tensors are on different devices: counted as transfers.
_COPY_OPS = frozenset({"copy_", "_copy_from", "_copy_from_and_resize", "_to_copy"})
# Collective operators must reach the process group with the wrappers intact.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


class _DeviceState:
    """Per-process state of the simulated device: the current index and its allocator."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.device_count = count
        self.index = 0
        self.reserved = [0] * count
        self.lock = threading.Lock()
        self.counters = {"transfers": 0, "collectives": 0}

    def count(self, what: str) -> None:
        with self.lock:
            self.counters[what] += 1

    def record_allocation(self, index: int, nbytes: int) -> None:
        with self.lock:
            self.reserved[index] += nbytes


_STATE: Optional[_DeviceState] = None


def _state() -> _DeviceState:
    if _STATE is None:
        raise RuntimeError("the simulated accelerator is not set up; call comm.testing.simulate_accelerator()")
    return _STATE


class SimulatedTensor(torch.Tensor):
    """A tensor on the simulated device; ``_payload`` holds its data on the CPU."""

    _payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor, index: int) -> "SimulatedTensor":
        state = _state()
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            payload.size(),
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=payload.dtype,
            layout=payload.layout,
            device=torch.device(state.name, index),
        )
        tensor._payload = payload
        state.record_allocation(index, payload.numel() * payload.element_size())
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        text = repr(self._payload)
        return f"{text[:-1]}, device='{self.device}')"

    # torch declares __torch_dispatch__ as a plain function; subclasses define a classmethod.
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return _run_on_payloads(func, args, kwargs or {})


def _boxed_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """PrivateUse1 kernel for every operator reached without a wrapper (factories)."""
    return _run_on_payloads(op, args, kwargs)


def counters() -> Dict[str, int]:
    """Host<->device transfers and collectives issued on the simulated device so far."""
    state = _state()
    with state.lock:
        return dict(state.counters)


def reset_counters() -> None:
    state = _state()
    with state.lock:
        state.counters = dict.fromkeys(state.counters, 0)


def _copy_kernel(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """PrivateUse1 ``copy_``: torch's C++ code (``torch.tensor(data, device=...)``)
    copies with the Python dispatch key excluded, where the boxed fallback fails."""
    result: torch.Tensor = _run_on_payloads(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})
    return result


def _run_on_payloads(func: Any, args: Any, kwargs: Dict[str, Any]) -> Any:
    if func.namespace in _COLLECTIVE_NAMESPACES:
        private_use1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
        return func.redispatch(private_use1, *args, **kwargs)
    state = _state()
    target = _target_device(func, args, kwargs, state)
    originals: Dict[int, torch.Tensor] = {}

    def unwrap(value: Any) -> Any:
        if isinstance(value, SimulatedTensor):
            originals[id(value._payload)] = value
            return value._payload
        if isinstance(value, torch.Tensor):
            originals[id(value)] = value
        elif isinstance(value, torch.device) and value.type == state.name:
            return torch.device("cpu")
        return value

    cpu_args, cpu_kwargs = tree_map(unwrap, (args, kwargs))
    if cpu_kwargs.get("device") is not None and torch.device(cpu_kwargs["device"]).type == state.name:
        cpu_kwargs["device"] = torch.device("cpu")
    result = func(*cpu_args, **cpu_kwargs)

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in originals:
                return originals[id(value)]
            if target.type == state.name:
                return SimulatedTensor(value, target.index)
        return value

    return tree_map(wrap, result)


def _target_device(func: Any, args: Any, kwargs: Dict[str, Any], state: _DeviceState) -> torch.device:
    """Where the results live: the ``device=`` argument, else the simulated inputs' device."""
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if kwargs.get("device") is not None:
        target = torch.device(kwargs["device"])
        if target.type == state.name and target.index is None:
            target = torch.device(state.name, state.index)
        if func._opname in _COPY_OPS and _crosses_devices(tensors, kwargs):
            state.count("transfers")
        return target
    simulated = [t for t in tensors if isinstance(t, SimulatedTensor)]
    if not simulated:
        return torch.device("cpu")
    if func._opname in _COPY_OPS and _crosses_devices(tensors, kwargs):
        state.count("transfers")
    if func._opname not in _CROSS_DEVICE_OPS:
        _check_same_device(tensors)
    return simulated[0].device


def _crosses_devices(tensors: List[torch.Tensor], kwargs: Dict[str, Any]) -> bool:
    types = {t.device.type for t in tensors}
    if kwargs.get("device") is not None:
        types.add(torch.device(kwargs["device"]).type)
    return len(types) > 1


def _check_same_device(tensors: List[torch.Tensor]) -> None:
    devices = []
    for tensor in tensors:
        if tensor.device.type == "cpu" and tensor.dim() == 0:
            continue  # a CPU scalar mixes with accelerator tensors, as on CUDA
        if tensor.device not in devices:
            devices.append(tensor.device)
    if len(devices) > 1:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two "
            f"devices, {devices[0]} and {devices[1]}!"
        )


class _DeviceContext:
    """``torch.<name>.device(index)``: make ``index`` current inside a ``with`` block."""

    def __init__(self, index: Any) -> None:
        self.index = _index_of(index)
        self.previous = 0

    def __enter__(self) -> None:
        self.previous = _state().index
        _set_device(self.index)

    def __exit__(self, *exc: Any) -> None:
        _set_device(self.previous)


def _index_of(device: Any) -> int:
    if isinstance(device, (torch.device, str)):
        device = torch.device(device).index or 0
    return int(device)


def _set_device(device: Any) -> None:
    state = _state()
    index = _index_of(device)
    if not 0 <= index < state.device_count:
        raise RuntimeError(f"Invalid device index {index}: the simulated {state.name} has {state.device_count} devices")
    state.index = index


def _current_device() -> int:
    return _state().index


def _device_count() -> int:
    return _state().device_count


def _memory_reserved(device: Any = None) -> int:
    state = _state()
    index = state.index if device is None else _index_of(device)
    return state.reserved[index]


def _empty_cache() -> None:
    state = _state()
    with state.lock:
        state.reserved[state.index] = 0


def _build_device_module(name: str) -> types.ModuleType:
    """The ``torch.<name>`` module a real accelerator plugin would install."""
    module = types.ModuleType(f"torch.{name}", f"Simulated {name} accelerator (comm.testing).")
    functions = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "device_count": _device_count,
        "current_device": _current_device,
        "set_device": _set_device,
        "device": _DeviceContext,
        "synchronize": lambda device=None: None,
        "empty_cache": _empty_cache,
        "memory_reserved": _memory_reserved,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }
    for attr, value in functions.items():
        setattr(module, attr, value)
    return module


def hooks_available() -> bool:
    return hasattr(torch._C, "_acc")


def install_device(name: str, device_count: int) -> None:
    """Rename PrivateUse1 to ``name`` and route its operators to the CPU payloads."""
    global _STATE
    if not hooks_available():
        raise RuntimeError(
            "simulating an accelerator needs torch's Python PrivateUse1 hooks (torch._C._acc); "
            f"torch {torch.__version__} lacks them"
        )
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _STATE = _DeviceState(name, device_count)
    _setup_privateuseone_for_python_backend(name, backend_module=_build_device_module(name))
    # torch.library is untyped in torch's stubs, hence the ignores.
    fallback = torch.library.Library("_", "IMPL")  # type: ignore[no-untyped-call]
    fallback.fallback(_boxed_fallback, dispatch_key="PrivateUse1", with_keyset=False)  # type: ignore[no-untyped-call]
    kernels = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    kernels.impl("copy_", _copy_kernel, "PrivateUse1")  # type: ignore[no-untyped-call]
    _LIBRARIES.extend([fallback, kernels])


# Keeps the fallback registration alive for the life of the process.
_LIBRARIES: List[Any] = []

