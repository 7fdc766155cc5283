"""Failures injected on purpose, for atomicity and fault tests.

``failure_problems`` is the check every atomicity test makes: a call whose
collectives fail (``comm.testing.fail_next``: the simulated backend's broken link)
raises the injected error, says what comm staged, and leaves the caller's tensors
as they were.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist

from comm.testing import FAILURE_MODES, fail_next

__all__ = ["FAILURE_MODES", "INJECTED", "failure_problems"]

INJECTED = "injected backend failure"


def failure_problems(
    label: str,
    call: Callable[[], Any],
    tensors: Sequence[torch.Tensor],
    group: Any,
    mode: str,
    calls: int = 1,
) -> List[str]:
    """Run ``call()`` with its next ``calls`` collectives failing in ``mode``; return what went wrong ([] if nothing).

    ``call`` must raise the injected error as the backend raised it, with comm's
    account of what it staged, and leave ``tensors`` (the caller's) bit-identical: a
    failed staged call must not hand back half-written data. Afterwards nothing fails
    any more and the ranks meet at a barrier of ``group``, so that a failure one rank
    saw alone does not leave its peer's next call unmatched.
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
    fail_next(mode, 0)
    dist.barrier(group=group)
    return problems


def _error_problems(label: str, mode: str, error: RuntimeError) -> List[str]:
    """What is wrong with ``error`` as the report of a failure injected in ``mode`` ([] if nothing)."""
    injected = f"{INJECTED} (on wait)" if mode == "fail_wait" else f"{INJECTED} (on call "
    problems = []
    if not str(error).startswith(injected):
        problems.append(f"{label} {mode}: unexpected error {error!r}")
    if "comm staged" not in str(error) + "".join(getattr(error, "__notes__", [])):
        problems.append(f"{label} {mode}: no account of what was staged")
    return problems
