"""A collective backend that fails on purpose, for atomicity and fault tests.

``faulty`` serves the simulated ``npu`` like ``hccl`` does, and fails the calls the
test chooses: by raising when the collective is issued, or by returning a work
whose ``wait()`` raises. It is a Python process group (c10d's one hook for a
backend written in Python) around the simulated C++ backend, which rejects tensors
of other devices with the error the group's own dispatch raises.

``failure_problems`` is the check every atomicity test makes with it: a call whose
collectives fail raises the injected error, says what comm staged, and leaves the
caller's tensors as they were.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Sequence, Set

import torch
import torch.distributed as dist

from comm.testing._process_group import create_backend

INJECTED = "injected backend failure"
# How an injected failure shows: "raise" when the collective is issued, "fail_wait" when its work is waited on.
FAILURE_MODES = ("raise", "fail_wait")

# ProcessGroup methods c10d calls on a Python group, and the Backend method for each.
_FORWARDED = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "broadcast": "broadcast",
    "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced",
    "_allgather_base": "_allgather_base",
    "all_gather_single": "_allgather_base",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall": "alltoall",
    "alltoall_base": "alltoall_base",
    "all_to_all_single": "alltoall_base",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv_anysource",
}


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


class FaultyProcessGroup(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, device_type: str):
        super().__init__(rank, size)
        self._inner = create_backend(store, rank, size, timeout, "faulty", frozenset())
        self._device_type = device_type
        self._group_name = ""

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return "faulty"

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def _device_types(self) -> List[torch.device]:
        return [torch.device(self._device_type)]


def _faulty(name: str, backend_name: str) -> Callable[..., Any]:
    def method(self: FaultyProcessGroup, *args: Any, **kwargs: Any) -> Any:
        PLAN.calls += 1
        if PLAN.calls in PLAN.raise_on:
            raise RuntimeError(f"{INJECTED} (on call {PLAN.calls})")
        work = getattr(self._inner, backend_name)(*args, **kwargs)
        return FailingWork(work) if PLAN.calls in PLAN.fail_wait_on else work

    method.__name__ = name
    return method


for _name, _backend_name in _FORWARDED.items():
    setattr(FaultyProcessGroup, _name, _faulty(_name, _backend_name))


def register_faulty_backend(device_type: str = "npu") -> None:
    """Make ``dist.new_group(backend="faulty")`` available in this (simulated) process."""

    def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> FaultyProcessGroup:
        return FaultyProcessGroup(store, rank, size, timeout, device_type)

    if "faulty" not in dist.Backend.backend_list:
        dist.Backend.register_backend("faulty", create, devices=[device_type])


def fail_next(mode: str, calls: int = 1) -> None:
    """Make the group's next ``calls`` collectives fail in ``mode`` (one of FAILURE_MODES), and no others."""
    PLAN.clear()
    failing = PLAN.raise_on if mode == "raise" else PLAN.fail_wait_on
    failing.update(range(PLAN.calls + 1, PLAN.calls + 1 + calls))


def failure_problems(
    label: str,
    call: Callable[[], Any],
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    mode: str,
    calls: int = 1,
) -> List[str]:
    """Run ``call()`` with its next ``calls`` collectives failing in ``mode``; return what went wrong ([] if nothing).

    ``call`` must raise the injected error as the backend raised it, with comm's note
    of what it staged, and leave ``tensors`` (the caller's) bit-identical: a failed
    staged call must not hand back half-written data. Afterwards nothing fails any
    more and the ranks meet at a barrier of ``group``, so that a failure one rank saw
    alone does not leave its peer's next call unmatched.
    """
    before = [tensor.clone() for tensor in tensors]
    fail_next(mode, calls)
    problems = []
    try:
        call()
        problems.append(f"{label} {mode}: no error")
    except RuntimeError as error:
        problems += _error_problems(label, mode, error)
    if not all(torch.equal(tensor, kept) for tensor, kept in zip(tensors, before)):
        problems.append(f"{label} {mode}: the caller's tensors changed")
    PLAN.clear()
    dist.barrier(group=group)
    return problems


def _error_problems(label: str, mode: str, error: RuntimeError) -> List[str]:
    """What is wrong with ``error`` as the report of a failure injected in ``mode`` ([] if nothing)."""
    injected = f"{INJECTED} (on wait)" if mode == "fail_wait" else f"{INJECTED} (on call "
    problems = []
    if not str(error).startswith(injected):
        problems.append(f"{label} {mode}: unexpected error {error!r}")
    if "comm staged" not in "".join(getattr(error, "__notes__", [])):
        problems.append(f"{label} {mode}: no note of what was staged")
    return problems
