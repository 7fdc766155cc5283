"""Test support: a simulated accelerator so CPU-only CI reproduces accelerator-only bugs.

After ``simulate_accelerator("npu", "hccl")`` a CPU-only process behaves like an
Ascend machine: ``torch.device("npu:1")``, ``.to("npu")`` (onto the current device),
``torch.accelerator``, ``init_process_group("hccl", device_id=...)``,
``init_device_mesh("npu", ...)``, DTensor, and FSDP2 with ``CPUOffloadPolicy`` work,
and a CPU tensor on the hccl group fails with ``No backend type associated with
device type cpu`` through ``torch.distributed`` and the functional collectives alike,
as on real hardware.

It is built as real accelerator plugins are: a C++ extension (``csrc/``), compiled
on first use and cached, registers a device guard (current device and stream per
thread), an allocator whose storages are host memory, the PrivateUse1 hooks (device
count, pinned host memory, storage resizing), copy kernels (counted as transfers),
a fallback that runs every other operator's CPU kernel on the same memory (with
kernels of its own, the CPU's run on the host, where torch sends a plugin's
convolutions and fused attention), and a c10d ``Backend`` that runs collectives with
gloo on that memory.

Collectives complete asynchronously on a worker per communicator, as on a device
stream: ``wait()`` makes the device wait, and operators, copies and synchronisations
wait for what their device was told to wait for, so a result read without waiting is
stale, as on hardware (docs/simulated-npu.md). Known differences from a real device:
operators run synchronously on the host when called (events record the host's time,
so timing events measure host time);
operators run the CPU's kernels (its dtypes, numerics and errors); device random
numbers are drawn by the CPU's kernels from the device generator's seed and offset
(the CPU's mt19937 numbers, not Philox's); collectives
run on gloo (what gloo lacks fails with gloo's error; ``unsupported_ops`` adds the
refusals of a real part, and :func:`fail_next` a broken link's failures);
device and pinned memory are cached as torch_npu's allocators cache them (a freed
block serves the next request of its rounded size, never a bigger one split);
``memory_allocated``, ``memory_reserved`` and their peaks are counted as torch_npu
counts them, ``empty_cache`` gives the cached blocks back, and a device has a capacity
(:func:`set_device_memory`) past which allocation raises torch_npu's out-of-memory
error; pinned memory is ordinary host memory that remembers it
was pinned. It needs torch >= 2.9 (its
headers are what the C++ is written against), a C++ compiler and ninja.
"""

from __future__ import annotations

import os
import threading
from typing import Any, FrozenSet, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from comm._native import SIMULATED
from comm.testing import _device, _process_group, _torch_npu
from comm.testing._device import (
    ALL_FAILURE_MODES,
    FAILURE_MODES,
    counters,
    device_counters,
    fail_next,
    pinned_memory,
    reset_counters,
    set_device_memory,
)

__all__ = [
    "ALL_FAILURE_MODES", "FAILURE_MODES", "apply_torch_npu_patches", "can_simulate", "counters", "device_counters",
    "fail_next", "offloaded", "pinned_memory",
    "reset_counters", "set_device_memory", "simulate_accelerator", "simulate_from_environment", "simulated_accelerator",
]

_LOCK = threading.Lock()
_ACTIVE: Optional[Tuple[str, str, int, FrozenSet[Any], bool, bool, Optional[bool]]] = None


def can_simulate() -> bool:
    """Whether this process can build and host the simulated accelerator.

    Its core is C++, compiled on first use: it needs torch >= 2.9 with its C++
    headers, a C++ compiler and ninja. Where any is missing this is False,
    :func:`simulate_accelerator` raises ``RuntimeError`` saying which, and test
    suites can skip what needs it.
    """
    return SIMULATED.unavailable_reason() is None


def simulate_accelerator(
    name: str = "npu",
    backend: str = "hccl",
    device_count: int = 8,
    unsupported_ops: Iterable[dist.ReduceOp.RedOpType] = (),
    lenient: bool = False,
    torch_npu_patches: bool = False,
    blocking_wait: Optional[bool] = None,
) -> None:
    """Set up a simulated accelerator ``name`` with collective backend ``backend`` in this process.

    The backend follows HCCL's rules (torch_npu's ProcessGroupHCCL): the dtypes each
    collective accepts, no bitwise reductions, no ``allgather_coalesced``, no receive
    from any source, AVG and PREMUL_SUM done by the backend. ``lenient=True`` drops
    those rules: every call runs as gloo runs it. ``unsupported_ops`` lists further
    reduce ops the backend rejects (``ReduceOp.AVG`` on some HCCL parts).
    ``torch_npu_patches`` (``npu`` only) replaces in torch what real torch_npu
    replaces at import, as real torch_npu's autoload does inside ``import torch``:
    see :func:`apply_torch_npu_patches`. Collectives complete asynchronously, as on a
    device stream: ``wait()`` makes the device, not the host, wait, and raises nothing;
    a failed collective reaches a watchdog that ends the process
    (``HCCL_ASYNC_ERROR_HANDLING=0``: it does not). ``blocking_wait=True`` is HCCL's
    blocking-wait mode for every group (``wait()`` blocks the host and raises the
    collective's error; no watchdog), the earlier simulation's behaviour; None (the
    default) reads ``TORCH_HCCL_BLOCKING_WAIT`` when each group's backend is made, as
    ProcessGroupHCCL does. PrivateUse1 can be claimed once
    per process: a second call with the same arguments does nothing, and any other
    second call, a call after a real plugin such as ``torch_npu`` was imported, or a
    call where :func:`can_simulate` is False raises ``RuntimeError``. The first call
    on a machine compiles the C++ core (about a minute on 2 cores); later ones load
    the cached build.
    """
    global _ACTIVE
    _check_arguments(name, backend, device_count)
    if not isinstance(torch_npu_patches, bool) or (torch_npu_patches and name != "npu"):
        raise ValueError(f"torch_npu_patches must be a bool, and True only for 'npu', got {torch_npu_patches!r} "
                         f"for {name!r}")
    ops = frozenset(unsupported_ops)
    if blocking_wait is not None and not isinstance(blocking_wait, bool):
        raise ValueError(f"blocking_wait must be None or a bool, got {blocking_wait!r}")
    wanted = (name, backend, device_count, ops, bool(lenient), torch_npu_patches, blocking_wait)
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
        _process_group.register_backend(backend, name, ops, bool(lenient), blocking_wait)
        if name == "npu":
            _torch_npu.install()
        if torch_npu_patches:
            _torch_npu.apply_patches()
        _ACTIVE = wanted


def apply_torch_npu_patches() -> None:
    """Replace in torch, now, what real torch_npu replaces at import, as it does; once per process.

    Real torch_npu puts objects of its own (not wrappers of what is there) in
    place of c10d's group-creation helper (a full copy of it), ``gather`` (one
    without ``group_dst``), ``batch_isend_irecv``, ``gather_object``,
    ``nn.Module.to`` and ``torch.load``. It does so inside ``import torch``
    (autoload: before comm, as ``simulate_accelerator(torch_npu_patches=True)``
    does), or at ``import torch_npu`` under ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``,
    which may come after ``comm.patch()``: call this there. Needs the simulated
    NPU (``simulate_accelerator("npu", ...)``) set up first.
    """
    if simulated_accelerator() != "npu":
        raise RuntimeError("apply_torch_npu_patches() needs the simulated NPU: call simulate_accelerator('npu') first")
    _torch_npu.apply_patches()


def simulate_from_environment() -> None:
    """The simulated accelerator ``COMM_SIMULATE`` names: ``npu`` or ``npu:hccl`` (device type, then backend),
    or ``cann``: the installed torch_npu on comm's fake CANN (:mod:`comm.testing.cann`).

    ``python -m comm --simulate npu`` sets it, so the script's spawned children simulate too.
    """
    value = os.environ.get("COMM_SIMULATE", "").strip()
    if value == "cann":  # the real torch_npu on comm's fake CANN, loaded before torch (comm._cann_boot)
        from comm.testing.cann import require_torch_npu

        require_torch_npu()
        return
    name, _, backend = value.partition(":")
    if not name.isidentifier() or (backend and not backend.isidentifier()):
        raise ValueError(f"COMM_SIMULATE={value!r} is not a device type with an optional backend; expected "
                         "a value such as 'npu' or 'npu:hccl'")
    simulate_accelerator(name, backend or "hccl")


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
    if isinstance(device_count, bool) or not isinstance(device_count, int) or not 1 <= device_count <= 64:
        raise ValueError(f"device_count must be a positive int, got {device_count!r} (the simulation has up to 64)")


def offloaded(tensor: torch.Tensor, mesh: "torch.distributed.device_mesh.DeviceMesh") -> torch.Tensor:
    """``tensor`` (a DTensor) seen on ``mesh``, its local shard left where it is.

    This is how FSDP2 with ``CPUOffloadPolicy`` presents gradients on an
    accelerator: local tensors on the CPU, mesh (and process group) on the device.
    ``DTensor.from_local`` cannot build it (it moves the local tensor to the mesh's
    device). The result shares the local tensor: scaling one scales the other.
    """
    # DTensor costs a second and more at import; only this helper needs it.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(tensor, DTensor):
        raise TypeError(f"tensor must be a DTensor, got {type(tensor).__name__}")
    meta = TensorMeta(tensor.shape, tensor.stride(), tensor.dtype)
    spec = DTensorSpec(mesh, tuple(tensor.placements), tensor_meta=meta)
    # DTensor's constructor is untyped in torch's stubs.
    return DTensor(tensor._local_tensor, spec, requires_grad=tensor.requires_grad)  # type: ignore[no-untyped-call]
