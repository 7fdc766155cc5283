"""A collective backend that fails on purpose, for atomicity and fault tests.

``faulty`` serves the simulated ``npu`` like ``hccl`` does, and fails the calls the
test chooses: by raising when the collective is issued, or by returning a work
whose ``wait()`` raises.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Set

import torch
import torch.distributed as dist

from comm.testing._process_group import _FORWARDED, SimulatedProcessGroup

INJECTED = "injected backend failure"


class FaultPlan:
    """Which calls (counted from 1 across all collectives of the group) fail, and how."""

    def __init__(self) -> None:
        self.calls = 0
        self.raise_on: Set[int] = set()
        self.fail_wait_on: Set[int] = set()

    def clear(self) -> None:
        self.raise_on.clear()
        self.fail_wait_on.clear()


PLAN = FaultPlan()


class FailingWork(dist.Work):
    """A finished collective whose result is an error, as a broken link reports it."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    def wait(self, timeout: Any = None) -> bool:
        self._inner.wait()
        raise RuntimeError(f"{INJECTED} (on wait)")

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError(f"{INJECTED} (on wait)"))
        return future


class FaultyProcessGroup(SimulatedProcessGroup):
    pass


def _faulty(name: str) -> Callable[..., Any]:
    forward = getattr(SimulatedProcessGroup, name)

    def method(self: FaultyProcessGroup, *args: Any, **kwargs: Any) -> Any:
        PLAN.calls += 1
        if PLAN.calls in PLAN.raise_on:
            raise RuntimeError(f"{INJECTED} (on call {PLAN.calls})")
        work = forward(self, *args, **kwargs)
        return FailingWork(work) if PLAN.calls in PLAN.fail_wait_on else work

    method.__name__ = name
    return method


for _name in _FORWARDED:
    setattr(FaultyProcessGroup, _name, _faulty(_name))


def register_faulty_backend(device_type: str = "npu") -> None:
    """Make ``dist.new_group(backend="faulty")`` available in this (simulated) process."""

    def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> FaultyProcessGroup:
        return FaultyProcessGroup(store, rank, size, timeout, device_type, "faulty", frozenset())

    if "faulty" not in dist.Backend.backend_list:
        dist.Backend.register_backend("faulty", create, devices=[device_type])
