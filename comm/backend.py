"""Backend resolution: which collective backend serves which device type.

Two questions live here. Which backend should a new job use on this accelerator
(``default_backend``)? And which device types can an existing group run collectives
on (``device_types``)? The second is the backend -> device mapping that the FSDP
offload report (second seed) found nobody owned.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, FrozenSet, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # not in torch.distributed.__all__

from comm import slot
from comm.device import accelerator_type, bind
from comm.groups import backend_capability, backend_string_device_types, device_types_of, resolve_group
from comm.launch import LaunchInfo, launch_info

__all__ = ["default_backend", "device_types", "init_process_group"]

# Backends to try per device type, after torch's own default (when it has one).
# torch's table (get_default_backend_for_device, torch >= 2.6) does not cover these:
_FALLBACK_BACKENDS = {
    # gloo serves CUDA tensors on builds without NCCL (Windows, some ROCm wheels).
    "cuda": ("nccl", "gloo"),
    # torch_npu registers hccl; torch < 2.6 has no per-device default to ask.
    "npu": ("hccl",),
    # xccl is built into torch >= 2.8; Intel's oneCCL bindings register the legacy
    # "ccl" name, which is used only when the build positively reports it.
    "xpu": ("xccl", "ccl"),
    "cpu": ("gloo",),
    # torch's own map sends MPS to gloo, which stages MPS tensors through the CPU.
    "mps": ("gloo",),
}



def default_backend(device_type: Optional[str] = None) -> str:
    """Return the collective backend to use for ``device_type`` (the accelerator by default).

    hccl for npu, xccl for xpu (legacy ``ccl`` only where the build reports it),
    nccl for cuda, gloo for cpu and mps, and the registered backend of any other
    device. A backend this build lacks is never returned, and a non-CUDA
    accelerator never falls back to nccl.
    """
    device_type = device_type or accelerator_type()
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f"device_type must be a device type string such as 'cuda', got {device_type!r}")
    candidates = _backend_candidates(device_type)
    for backend in candidates:
        if _backend_available(backend):
            return backend
    tried = ", ".join(candidates) if candidates else "none known"
    raise RuntimeError(
        f"no collective backend available for device type {device_type!r} "
        f"(tried: {tried}); install the accelerator's plugin or pass backend= explicitly"
    )


def _backend_candidates(device_type: str) -> List[str]:
    candidates = []
    torch_default = _torch_default_backend(device_type)
    if torch_default is not None:
        candidates.append(torch_default)
    for backend in _FALLBACK_BACKENDS.get(device_type, ()):
        if backend not in candidates:
            candidates.append(backend)
    if device_type != "cuda" and "nccl" in candidates:
        # torch_npu's transfer_to_npu aliases is_nccl_available: never trust it off CUDA.
        candidates.remove("nccl")
    return candidates


def _torch_default_backend(device_type: str) -> Optional[str]:
    if hasattr(dist, "get_default_backend_for_device"):
        try:
            return str(dist.get_default_backend_for_device(device_type))
        except (ValueError, RuntimeError):
            return None
    default = dist.Backend.default_device_backend_map.get(device_type)
    return None if default is None else str(default)


def _backend_available(backend: str) -> bool:
    probe = getattr(dist, f"is_{backend}_available", None)
    if callable(probe):
        return bool(probe())
    return backend in dist.Backend.backend_list


def init_process_group(backend: Optional[str] = None, **kwargs: Any) -> torch.device:
    """Bind this process, then initialise the default group; return the bound device.

    Calls :func:`torch.distributed.init_process_group` with :func:`default_backend`
    unless ``backend`` is given (an explicit backend always wins), and binds the
    group to the device (``device_id``) where torch and the backend support it.
    Under srun, mpirun or jsrun the rank, world size and rendezvous address come
    from :func:`comm.launch_info`; a single process gets a group of one. What the
    caller passes (``rank``, ``world_size``, ``store``, ``init_method``) wins, and
    under torchrun torch reads its own variables. The group is then equipped with
    comm's staging backend (:func:`comm.equip`) where it can be built.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name such as 'nccl' or 'cpu:gloo,cuda:nccl', got {backend!r}")
    rendezvous = _rendezvous(launch_info(), kwargs)
    device = bind()
    if backend is None:
        backend = default_backend(device.type)
    if (
        device.type != "cpu"
        and "device_id" not in kwargs
        and _accepts_device_id()
        and device.type in backend_string_device_types(backend)
        # torch binds every later group to the default group's device_id and asks that
        # group's backend for it: bound to an npu or xpu, dist.new_group(backend="gloo")
        # (the CPU group of CPU offload) fails with "No backend type associated with
        # device type npu". Bind only to devices gloo serves too.
        and device.type in backend_capability("gloo")
    ):
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, **rendezvous, **kwargs)
    if slot.unavailable_reason() is None:
        slot.equip()
    return device


def _rendezvous(info: LaunchInfo, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """What torch needs to meet the other ranks of this launch that the caller did not pass."""
    if info.launcher == "torchrun":
        return {}  # torch's env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself
    added: Dict[str, Any] = {key: value for key, value in (("rank", info.rank), ("world_size", info.world_size))
                             if key not in kwargs}
    if "store" in kwargs or "init_method" in kwargs:
        return added
    if info.launcher == "single":
        if kwargs.get("world_size", 1) == 1:
            added["store"] = HashStore()  # a group of one meets no one
        return added
    if info.master_addr is None or info.master_port is None:
        raise ValueError(_missing_rendezvous(info))
    host = f"[{info.master_addr}]" if ":" in info.master_addr else info.master_addr
    added["init_method"] = f"tcp://{host}:{info.master_port}"
    return added


def _missing_rendezvous(info: LaunchInfo) -> str:
    missing = [name for name, value in (("MASTER_ADDR", info.master_addr), ("MASTER_PORT", info.master_port))
               if value is None]
    verb = "are" if len(missing) > 1 else "is"
    return (f"{' and '.join(missing)} {verb} not set, so comm cannot tell where rank 0 of this {info.launcher} "
            "launch listens; expected MASTER_ADDR (the host name or address of rank 0's node) and MASTER_PORT "
            "(a free port there) in every rank's environment, or init_method= or store= passed")


def _accepts_device_id() -> bool:
    return "device_id" in inspect.signature(dist.init_process_group).parameters


def device_types(group: Optional[dist.ProcessGroup] = None) -> FrozenSet[str]:
    """The device types ``group`` (the default group by default) can run collectives on.

    Asked of the group's registered backends (comm's staging backend among them,
    once equipped), else of its backend config (``"cpu:gloo,cuda:nccl"``), else of
    ``Backend.backend_capability``.
    """
    return device_types_of(resolve_group(group))


