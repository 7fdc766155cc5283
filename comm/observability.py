"""Observability: what staging cost, per collective.

comm's staging backend counts, in C++, every call it stages, whatever road it came
by (torch.distributed's functions, functional collectives, DDP, the coalescing
manager, comm's own calls): the staged calls, the host-device copies, their bytes
and the time spent copying. Staging in plain Python (:mod:`comm.python_staging`) adds to
the same figures. Calls on devices the group serves are torch's and not counted.
"""

from __future__ import annotations

import threading
from typing import Dict, List

from comm._native import STAGING

__all__ = ["count_staged", "reset_stats", "stats"]

_FIELDS = ("staged_calls", "transfers", "bytes_staged", "staging_seconds")
_LOCK = threading.Lock()
# What plain-Python staging did: collective -> [calls, transfers, bytes, seconds].
_PYTHON: Dict[str, List[float]] = {}


def count_staged(op: str, transfers: int, nbytes: int, seconds: float) -> None:
    """Count one call of ``op`` staged in Python, with its copies."""
    with _LOCK:
        entry = _PYTHON.setdefault(op, [0, 0, 0, 0.0])
        for index, value in enumerate((1, transfers, nbytes, seconds)):
            entry[index] += value


def stats() -> Dict[str, Dict[str, float]]:
    """Per collective that staged: ``staged_calls``, ``transfers``, ``bytes_staged`` and ``staging_seconds``.

    Summed over all threads since the start or the last :func:`reset_stats`.
    """
    with _LOCK:
        totals = {op: list(values) for op, values in _PYTHON.items()}
    for op, tally in _native_tallies().items():
        entry = totals.setdefault(op, [0, 0, 0, 0.0])
        for index, value in enumerate((tally["calls"], tally["transfers"], tally["bytes"],
                                       tally["nanoseconds"] / 1e9)):
            entry[index] += value
    return {op: dict(zip(_FIELDS, values)) for op, values in sorted(totals.items())}


def reset_stats() -> None:
    """Zero every figure."""
    with _LOCK:
        _PYTHON.clear()
    if STAGING.is_loaded():
        STAGING.load().reset_tallies()


def _native_tallies() -> Dict[str, Dict[str, int]]:
    if not STAGING.is_loaded():
        return {}
    tallies: Dict[str, Dict[str, int]] = STAGING.load().tallies()
    return tallies
