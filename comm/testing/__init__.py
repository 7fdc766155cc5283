"""Test support: a simulated accelerator so CPU-only CI reproduces accelerator-only bugs.

After ``simulate_accelerator("npu", "hccl")`` a CPU-only process behaves, for
collectives, like an Ascend machine: ``torch.device("npu:1")``, ``.to("npu")``,
``torch.accelerator``, ``init_process_group("hccl")`` and
``init_device_mesh("npu", ...)`` work, and an hccl collective on a CPU tensor fails
with ``No backend type associated with device type cpu``, as it does on real hardware.

Known differences from a real device: tensors are wrapper subclasses, so storage
tricks (``untyped_storage().resize_``, ``param.data = ...``) are unsupported and
FSDP2 cannot host its parameters here; backward runs on ``npu:0`` only (torch's
autograd engine sizes its device queues from a C++ device guard that a Python
backend cannot implement), so train one process per node; a composite backend
string naming the simulated backend (``"cpu:gloo,npu:hccl"``) yields a group that
serves only the simulated device (c10d hands a Python process group every device);
and ``device_id`` does not reach the group's ``bound_device_id`` (c10d replaces the
group object it set it on), so staging targets the bound local rank instead; and
``.to("npu")`` without an index lands on ``npu:0`` whatever device is current (torch
resolves it through a C++ device guard that a Python backend cannot replace), while
``torch.empty(..., device="npu")`` and explicit indices behave as on hardware.
"""

from __future__ import annotations

import threading
from typing import Any, FrozenSet, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from comm.testing import _device, _native, _process_group
from comm.testing._device import counters, reset_counters

__all__ = ["can_simulate", "counters", "offloaded", "reset_counters", "simulate_accelerator", "simulated_accelerator"]

_LOCK = threading.Lock()
_ACTIVE: Optional[Tuple[str, str, int, FrozenSet[Any]]] = None


def can_simulate() -> bool:
    """Whether this process can build and host the simulated accelerator.

    Its core is C++, compiled on first use: it needs torch >= 2.13 with its C++
    headers, a C++ compiler and ninja. Where any is missing this is False,
    :func:`simulate_accelerator` raises ``RuntimeError`` saying which, and test
    suites can skip what needs it.
    """
    return _native.unavailable_reason() is None


def simulate_accelerator(
    name: str = "npu",
    backend: str = "hccl",
    device_count: int = 8,
    unsupported_ops: Iterable[dist.ReduceOp.RedOpType] = (),
) -> None:
    """Set up a simulated accelerator ``name`` with collective backend ``backend`` in this process.

    ``unsupported_ops`` lists reduce ops the backend rejects (``ReduceOp.AVG`` on
    some HCCL parts), to exercise capability gaps. PrivateUse1 can be claimed once
    per process: a second call with the same arguments does nothing, and any other
    second call, or a call after a real plugin such as ``torch_npu`` was imported,
    raises ``RuntimeError``.
    """
    global _ACTIVE
    _check_arguments(name, backend, device_count)
    ops = frozenset(unsupported_ops)
    wanted = (name, backend, device_count, ops)
    with _LOCK:
        if _ACTIVE == wanted:
            return
        if _ACTIVE is not None:
            raise RuntimeError(f"a simulated accelerator is already set up in this process: {_ACTIVE[:3]}")
        owner = torch._C._get_privateuse1_backend_name()
        if owner != "privateuseone":
            raise RuntimeError(
                f"PrivateUse1 already belongs to {owner!r} (a real accelerator plugin?); "
                "the simulation must run in a process without it"
            )
        _device.install_device(name, device_count)
        _process_group.register_backend(backend, name, ops)
        _ACTIVE = wanted


def simulated_accelerator() -> Optional[str]:
    """The simulated device type set up in this process, or None."""
    return None if _ACTIVE is None else _ACTIVE[0]


def _check_arguments(name: str, backend: str, device_count: int) -> None:
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise ValueError(f"name must be a lower-case identifier such as 'npu', got {name!r}")
    try:
        torch.device(name)
    except RuntimeError:
        pass
    else:
        if name != torch._C._get_privateuse1_backend_name():
            raise ValueError(f"name must not be a built-in device type, got {name!r}")
    if not isinstance(backend, str) or not backend.isidentifier() or backend != backend.lower():
        raise ValueError(f"backend must be a lower-case identifier such as 'hccl', got {backend!r}")
    ours = _ACTIVE is not None and _ACTIVE[1] == backend
    if backend in dist.Backend.backend_list and not ours:
        raise ValueError(f"backend {backend!r} is already registered with torch.distributed; expected a new name")
    if isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device_count must be a positive int, got {device_count!r}")


def offloaded(tensor: torch.Tensor, mesh: "torch.distributed.device_mesh.DeviceMesh") -> torch.Tensor:
    """``tensor`` (a DTensor) seen on ``mesh``, its local shard left where it is.

    This is how FSDP2 with ``CPUOffloadPolicy`` presents gradients on an
    accelerator: local tensors on the CPU, mesh (and process group) on the device.
    ``DTensor.from_local`` cannot build it (it moves the local tensor to the mesh's
    device). The result shares the local tensor: scaling one scales the other.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(tensor, DTensor):
        raise TypeError(f"tensor must be a DTensor, got {type(tensor).__name__}")
    meta = TensorMeta(tensor.shape, tensor.stride(), tensor.dtype)
    spec = DTensorSpec(mesh, tuple(tensor.placements), tensor_meta=meta)
    # DTensor's constructor is untyped in torch's stubs.
    return DTensor(tensor._local_tensor, spec, requires_grad=tensor.requires_grad)  # type: ignore[no-untyped-call]
