"""The simulated device's collective backend, registered with c10d like a real plugin's.

The creator returns a C++ ``c10d::Backend`` (``csrc/backend.cpp``) over a gloo
backend. Because it is a Backend and not a Python ProcessGroup, c10d registers it
on the group for its device type and the group dispatches by device: a CPU tensor
on an hccl group fails in c10d with ``No backend type associated with device type
cpu``, as with the real plugin, through ``torch.distributed`` and the functional
collectives alike; ``init_process_group(device_id=...)`` keeps ``bound_device_id``;
and ``"cpu:gloo,npu:hccl"`` serves both devices.
"""

from __future__ import annotations

import datetime
from typing import Any, FrozenSet, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from comm._native import SIMULATED


def create_backend(
    store: Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    backend_name: str,
    unsupported_ops: FrozenSet[dist.ReduceOp.RedOpType],
    lenient: bool = False,
    blocking_wait: Optional[bool] = None,
) -> Any:
    """A simulated backend for one group: gloo underneath, ``backend_name`` on top (HCCL's rules unless ``lenient``).

    ``blocking_wait`` None: as ``TORCH_HCCL_BLOCKING_WAIT`` says when the backend is made.
    """
    host = dist.ProcessGroupGloo(store, rank, size, timeout)
    refused = {int(op.value): op.name for op in unsupported_ops}
    mode = -1 if blocking_wait is None else int(blocking_wait)
    return SIMULATED.load().make_backend(host, backend_name, refused, lenient, mode)


def register_backend(
    backend_name: str, device_type: str, unsupported_ops: FrozenSet[dist.ReduceOp.RedOpType], lenient: bool = False,
    blocking_wait: Optional[bool] = None,
) -> None:
    """Register ``backend_name`` with c10d as the backend of ``device_type``."""

    def create(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        return create_backend(store, rank, size, timeout, backend_name, unsupported_ops, lenient, blocking_wait)

    dist.Backend.register_backend(backend_name, create, devices=[device_type])
