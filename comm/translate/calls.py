"""Where code written for CUDA hands torch a device or a backend: one translator at each.

Every stand-in here does the same thing: find the device (or backend, or device
type) argument, pass it through :func:`comm.translate.translated_device`, and call
torch's own function. A device that is not CUDA's passes unchanged, so code written
for the accelerator (or the CPU) pays one type check.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from comm.backend import default_backend
from comm.translate.classes import Generator
from comm.translate.core import NOTED, note, target_type, targets_of, translated_device, translated_type
from comm.translate.cuda import current_device

__all__ = ["factory_names", "translated_backend", "targets"]

_tensor_to = torch._C.TensorBase.to
_pin_memory = torch._C.TensorBase.pin_memory


def factory_names() -> List[str]:
    """torch's functions whose operator takes a ``device`` argument: the factories."""
    names = []
    for name in dir(torch._C._VariableFunctions):
        if name.startswith("_") or not hasattr(torch, name):
            continue
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
        if any(argument.name == "device" for schema in schemas for argument in schema.arguments):
            names.append(name)
    return names + [name for name in ("asarray", "frombuffer") if hasattr(torch, name)]


def _changed(kind: str, given: Any, became: Any) -> None:
    if kind not in NOTED:
        note(kind, lambda: f"{kind}(device={given!r}) into device={became!r}")


def _to(original: Callable[..., Any], kind: str, method: bool = True) -> Callable[..., Any]:
    """``Tensor.to``, ``Module.to`` and ``torch._C._nn._parse_to``: the device (first or ``device=``) translated.

    ``_parse_to`` (not a ``method``: nothing comes before its device) reads ``.to``'s
    arguments as ``Module.to`` and ``PackedSequence.to`` do, and as libraries that move
    their own containers do (tensordict's ``TensorDict.to``), so a device is translated
    wherever ``.to``'s arguments are read, not only at the two ``to`` comm stands in for.
    """
    position = 1 if method else 0

    @functools.wraps(original)
    def to(*args: Any, **kwargs: Any) -> Any:
        if len(args) > position:
            first = args[position]
            if first.__class__ is not str or first.startswith("cuda"):  # (a string of another device: as is)
                translated = translated_device(first)
                if translated is not first:
                    if kind not in NOTED:
                        _changed(kind, first, translated)
                    args = args[:position] + (translated,) + args[position + 1:]
        if kwargs and "device" in kwargs:
            given = kwargs["device"]
            kwargs["device"] = translated_device(given)
            if kwargs["device"] is not given:
                _changed(kind, given, kwargs["device"])
        return original(*args, **kwargs)

    return to


# Tensor.cuda's device index as the string translated_device caches ("cuda:N").
_CUDA_INDEX = tuple(f"cuda:{index}" for index in range(64))


def tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
                memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """``Tensor.cuda(device)`` (and so ``Module.cuda``): ``.to`` the accelerator's device ``device``.

    No device means the current one: ``"cuda"`` becomes the accelerator's type, which
    ``.to`` puts on its current device, as ``.cuda()`` does on CUDA.
    """
    if device is None:
        device = "cuda"
    elif device.__class__ is int:
        device = _CUDA_INDEX[device] if 0 <= device < len(_CUDA_INDEX) else f"cuda:{device}"
    target = translated_device(device)
    _changed("Tensor.cuda", device, target)
    if memory_format is torch.preserve_format:
        result: torch.Tensor = _tensor_to(self, target, non_blocking=non_blocking)
    else:
        result = _tensor_to(self, target, non_blocking=non_blocking, memory_format=memory_format)
    return result


def tensor_pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Pinning needs an accelerator: on the CPU alone the tensor stays as it is."""
    if target_type() == "cpu":
        note("Tensor.pin_memory", lambda: "Tensor.pin_memory() into nothing (no accelerator to pin for)")
        return self
    args = tuple(translated_device(arg) for arg in args)
    result: torch.Tensor = _pin_memory(self, *args, **kwargs)
    return result


def _factory(original: Callable[..., Any], owner: str = "torch") -> Callable[..., Any]:
    """A function or method that takes ``device=`` (and ``pin_memory=``): the factories, ``Tensor.new_*``."""
    name = f"{owner}.{original.__name__}"

    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            given = kwargs.get("device")
            if given is not None and (given.__class__ is not str or given.startswith("cuda")):
                became = kwargs["device"] = translated_device(given)
                if became is not given:
                    _changed(name, given, became)
            if kwargs.get("pin_memory") and target_type() == "cpu":
                note(f"{name}(pin_memory)", lambda: f"{name}(pin_memory=True) into pin_memory=False (no accelerator)")
                kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    if owner == "torch":
        # TorchScript compiles a call to torch.zeros as aten::zeros; without this entry it
        # would try to compile the stand-in's Python (as transfer_to_npu's wrappers make it).
        torch.jit._builtins._register_builtin(factory, f"aten::{original.__name__}")
    return factory


def _data_loader_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DataLoader(pin_memory=True, pin_memory_device="cuda")``: the accelerator's, or no pinning on the CPU."""

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("pin_memory_device"):
            kwargs["pin_memory_device"] = translated_type(kwargs["pin_memory_device"])
        if kwargs.get("pin_memory") and target_type() == "cpu":
            note("DataLoader(pin_memory)", lambda: "DataLoader(pin_memory=True) into pin_memory=False (no accelerator)")
            kwargs["pin_memory"] = False
        original(self, *args, **kwargs)

    return init


def _device_context_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``with torch.device("cuda")``, ``torch.set_default_device("cuda")``: the context's device translated.

    Both make a ``DeviceContext`` (torch/utils/_device.py; ``with torch.device(...)``
    makes one from C++), the torch function mode that gives factories called without a
    device the context's device. Its class stays torch's, so torch's own ``isinstance``
    checks on the mode stack still find it; only the device it is given is translated.
    """

    @functools.wraps(original)
    def init(self: Any, device: Any) -> None:
        became = translated_device(device)
        if became is not device:
            _changed("torch.device context", device, became)
        original(self, became)

    return init


def translated_backend(backend: Any) -> Any:
    """``"nccl"`` becomes :func:`comm.default_backend`; ``"cuda:nccl"`` the accelerator's pair.

    In a composite (``"cpu:gloo,cuda:nccl"``) each ``cuda`` becomes the accelerator and
    each ``nccl`` that device's default backend; a device named twice (on a CPU-only
    machine ``cuda`` becomes ``cpu``) keeps its first entry, so ``"cpu:gloo,cuda:nccl"``
    collapses to ``"cpu:gloo"``. Anything without ``nccl`` or ``cuda`` is unchanged.
    """
    if not isinstance(backend, str) or ("nccl" not in backend.lower() and "cuda" not in backend.lower()):
        return backend
    if ":" not in backend:
        return default_backend(target_type()) if backend.lower() == "nccl" else backend
    pairs: Dict[str, str] = {}
    for entry in backend.split(","):
        device_type, _, name = entry.strip().partition(":")
        device_type = translated_type(device_type.strip().lower())
        name = name.strip()
        pairs.setdefault(device_type, default_backend(device_type) if name.lower() == "nccl" else name)
    return ",".join(f"{device_type}:{name}" for device_type, name in pairs.items())


def _group_creator(original: Callable[..., Any]) -> Callable[..., Any]:
    """``init_process_group`` / ``new_group``: translate ``backend`` and ``device_id``."""
    signature = inspect.signature(original)
    name = original.__name__

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        arguments = bound.arguments
        given = arguments.get("backend")
        if given is not None:
            arguments["backend"] = translated_backend(given)
            if arguments["backend"] != given:
                note(f"{name}(backend)", lambda: f"{name}(backend={given!r}) into backend={arguments['backend']!r}")
        device_id = arguments.get("device_id")
        if device_id is not None:
            became = translated_device(device_id)
            if became is not device_id and torch.device(became).type == "cpu":
                became = None  # a group is bound to an accelerator device, never the CPU
            arguments["device_id"] = became
            if became is not device_id:
                note(f"{name}(device_id)", lambda: f"{name}(device_id={device_id!r}) into device_id={became!r}")
        return original(*bound.args, **bound.kwargs)

    return create


def _ddp_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's ``device_ids`` and ``output_device`` on the accelerator; none for a CPU module."""

    @functools.wraps(original)
    def init(self: Any, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None,
             *args: Any, **kwargs: Any) -> None:
        given = (device_ids, output_device)
        if target_type() == "cpu" and all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        else:
            if device_ids is not None:
                device_ids = [translated_device(d) for d in device_ids]
            if output_device is not None:
                output_device = translated_device(output_device)
        if (device_ids, output_device) != given:
            note("DistributedDataParallel", lambda: f"DistributedDataParallel(device_ids={given[0]!r}, output_device="
                 f"{given[1]!r}) into device_ids={device_ids!r}, output_device={output_device!r}")
        original(self, module, device_ids, output_device, *args, **kwargs)

    return init


def _first_argument_type(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """A call whose first argument (or ``device_type=``/``device=``) is a device type: autocast, GradScaler, meshes."""
    parameter = next(iter(p for p in inspect.signature(original).parameters if p != "self"))
    is_method = "self" in inspect.signature(original).parameters

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        position = 1 if is_method else 0
        if len(args) > position:
            given = args[position]
            args = args[:position] + (translated_type(given),) + args[position + 1:]
        elif parameter in kwargs or kind == "GradScaler":  # GradScaler's device defaults to "cuda"
            given = kwargs.get(parameter, "cuda")
            kwargs[parameter] = translated_type(given)
        else:
            given = None
        if given == "cuda":
            note(kind, lambda: f"{kind}({given!r}) into {kind}({target_type()!r})")
        return original(*args, **kwargs)

    return call


def _map_location(given: Any) -> Any:
    """``torch.load``'s ``map_location`` with CUDA locations sent to this process's device.

    A checkpoint saved on ``cuda:N`` lands on this process's current accelerator
    device (or the CPU) when ``map_location`` is None, a dict that does not map the
    location, or a callable that returns None; a string or device is translated.
    """
    from torch.serialization import default_restore_location

    def restore(storage: Any, location: str) -> Any:
        if location.startswith("cuda"):
            location = str(translated_device(torch.device("cuda", current_device())))
        return default_restore_location(storage, location)  # type: ignore[no-untyped-call]

    if given is None:
        return restore
    if isinstance(given, dict):
        def mapped(storage: Any, location: str) -> Any:
            if location not in given:
                return restore(storage, location)
            return default_restore_location(storage, str(translated_device(given[location])))  # type: ignore[no-untyped-call]

        return mapped
    if isinstance(given, (str, torch.device)):
        return translated_device(given)
    if callable(given):
        def call(storage: Any, location: str) -> Any:
            result = given(storage, location)
            return restore(storage, location) if result is None else result

        return call
    return given


def _load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        note("torch.load", lambda: f"torch.load(map_location={map_location!r}) with cuda locations into "
             f"{target_type()}")
        return original(f, _map_location(map_location), *args, **kwargs)

    return load


def _method(owner: type, name: str, make: Callable[[Any], Any]) -> Tuple[Any, str, Any]:
    return (owner, name, make(getattr(owner, name)))


@functools.lru_cache(maxsize=None)
def targets() -> List[Tuple[Any, str, Any]]:
    """What to replace: made once, so the stand-ins (and TorchScript's entries for them) live as long as torch.

    What an older torch lacks (``torch.amp.GradScaler`` before 2.3, ``device_mesh``
    before 2.2) is left out.
    """
    from torch.amp.autocast_mode import autocast
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    found: List[Tuple[Any, str, Any]] = [
        (torch.Tensor, "to", _to(_tensor_to, "Tensor.to")),
        _method(torch.nn.Module, "to", lambda f: _to(f, "Module.to")),
        (torch._C._nn, "_parse_to", _to(torch._C._nn._parse_to, "torch._C._nn._parse_to", method=False)),
        (torch.Tensor, "cuda", tensor_cuda),
        (torch.Tensor, "pin_memory", tensor_pin_memory),
        (torch, "Generator", Generator),
        _method(DistributedDataParallel, "__init__", _ddp_init),
        _method(DataLoader, "__init__", _data_loader_init),
        _method(autocast, "__init__", lambda f: _first_argument_type(f, "torch.autocast")),
    ]
    scaler = _optional("torch.amp.grad_scaler")
    if scaler is not None:
        found.append(_method(scaler.GradScaler, "__init__", lambda f: _first_argument_type(f, "GradScaler")))
    found += [(torch, name, _factory(getattr(torch, name))) for name in factory_names()]
    found += [(torch.Tensor, name, _factory(getattr(torch.Tensor, name), "Tensor"))
              for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")]
    found.append(_method(_device_context(), "__init__", _device_context_init))
    c10d = dist.distributed_c10d
    for name in ("init_process_group", "new_group"):
        found += targets_of([dist, c10d], name, _group_creator)
    mesh = _optional("torch.distributed.device_mesh")
    if mesh is not None:
        found += targets_of([dist, mesh], "init_device_mesh", lambda f: _first_argument_type(f, "init_device_mesh"))
    found += targets_of([torch, torch.serialization], "load", _load)
    return found


def findable(owner: Any, name: str, stand_in: Any) -> Any:
    """``stand_in`` named for where it stands, so that ``pickle`` finds it as it finds torch's object.

    ``functools.wraps`` copies a builtin's ``__qualname__`` (``_VariableFunctionsClass.zeros``),
    under which pickle, which saves a function by its module and qualified name, finds
    nothing; torch's own object pickles by reference. A stand-in already findable where it
    stands (one for a Python function, a class, a module) is left as it is.
    """
    if not isinstance(stand_in, types.FunctionType) or isinstance(owner, dict):
        return stand_in
    if isinstance(owner, type):
        module, qualname = owner.__module__, f"{owner.__qualname__}.{name}"
    else:
        module, qualname = owner.__name__, name
    if _found_at(module, stand_in.__qualname__) is not getattr(owner, name, None):
        stand_in.__module__, stand_in.__qualname__ = module, qualname
    return stand_in


def _found_at(module: str, qualname: str) -> Any:
    """What ``pickle`` finds at ``module`` and ``qualname``: None where it finds nothing."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def _device_context() -> type:
    """torch's device context class: the function mode behind ``with torch.device`` and the default device."""
    from torch.utils._device import DeviceContext

    return DeviceContext


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
