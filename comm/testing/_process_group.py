"""A collective backend for the simulated device: a Python process group over gloo.

c10d does not dispatch a Python process group by device type, so this one checks
devices itself and raises the real backend's error for a tensor it does not serve:
``No backend type associated with device type cpu``.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, FrozenSet, List

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store
from torch.utils._pytree import tree_flatten, tree_map

from comm.testing._device import SimulatedTensor, _state

# The ProcessGroup methods c10d calls on a backend, and gloo's name for each.
_FORWARDED = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "broadcast": "broadcast",
    "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced",
    "_allgather_base": "_allgather_base",
    "all_gather_single": "_allgather_base",  # torch >= 2.12 spelling
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "reduce_scatter_single": "_reduce_scatter_base",  # torch >= 2.12 spelling
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall": "alltoall",
    "alltoall_base": "alltoall_base",
    "all_to_all_single": "alltoall_base",  # torch >= 2.12 spelling
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv_anysource",
}


class SimulatedProcessGroup(dist.ProcessGroup):
    """Runs collectives of simulated-device tensors with gloo on their CPU payloads."""

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        device_type: str,
        backend_name: str,
        unsupported_ops: FrozenSet[dist.ReduceOp.RedOpType],
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # Python groups take (rank, size)
        self._inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._device_type = device_type
        self._backend_name = backend_name
        self._unsupported_ops = unsupported_ops
        self._group_name = ""

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return self._backend_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # c10d's GroupName is a str
        return self._group_name

    # A real plugin registers itself as the group's backend for its device type;
    # c10d asks for it by device (init_process_group(device_id=...) does).
    supports_splitting = False

    @property
    def _device_types(self) -> List[torch.device]:
        return [torch.device(self._device_type)]

    def _get_backend(self, device: torch.device) -> "SimulatedProcessGroup":  # type: ignore[override]
        if torch.device(device).type != self._device_type:
            raise RuntimeError(f"No backend type associated with device type {torch.device(device).type}")
        return self

    def _check(self, args: Any, kwargs: Any) -> None:
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, torch.Tensor) and value.device.type != self._device_type:
                raise RuntimeError(f"No backend type associated with device type {value.device.type}")
            op = getattr(value, "reduceOp", None)
            if op is not None and op.op in self._unsupported_ops:
                raise RuntimeError(f"Cannot use ReduceOp.{op.op.name} with {self._backend_name.upper()}")


def _payload(value: Any) -> Any:
    return value._payload if isinstance(value, SimulatedTensor) else value


def _forwarding(name: str, gloo_name: str) -> Callable[..., Any]:
    def method(self: SimulatedProcessGroup, *args: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs)
        _state().count("collectives")
        args, kwargs = tree_map(_payload, (args, kwargs))
        return getattr(self._inner, gloo_name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{gloo_name}`` on the CPU payloads, through gloo."
    return method


for _name, _gloo_name in _FORWARDED.items():
    setattr(SimulatedProcessGroup, _name, _forwarding(_name, _gloo_name))


def register_backend(
    backend_name: str, device_type: str, unsupported_ops: FrozenSet[dist.ReduceOp.RedOpType]
) -> None:
    """Register ``backend_name`` with c10d as the backend of ``device_type``."""

    def create(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> SimulatedProcessGroup:
        return SimulatedProcessGroup(store, rank, size, timeout, device_type, backend_name, unsupported_ops)

    dist.Backend.register_backend(backend_name, create, devices=[device_type])
