"""Observability: how often each collective ran, and what staging cost.

Counters are kept per thread and summed on read, so counting a call takes no lock.
A counter, once made, lives as long as its thread: resetting zeroes it in place,
so the all-reduce fast path can hold on to its own and count with one increment.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Set, Tuple

__all__ = ["reset_stats", "stats"]

logger = logging.getLogger("comm")

_FIELDS = ("calls", "staged_calls", "bytes_staged", "staging_seconds")


class _ThreadCounters(threading.local):
    def __init__(self) -> None:
        self.counts: Dict[str, List[float]] = {}
        with _REGISTRY_LOCK:
            _REGISTRY.append(self.counts)


_REGISTRY_LOCK = threading.Lock()
_REGISTRY: List[Dict[str, List[float]]] = []
_LOCAL = _ThreadCounters()
_LOGGED_LOCK = threading.Lock()
_LOGGED: Set[Tuple[str, int, str]] = set()


def thread_counter(op: str) -> List[float]:
    """This thread's counter for ``op``: calls, staged calls, bytes staged, seconds staging."""
    counts = _LOCAL.counts
    entry = counts.get(op)
    if entry is None:
        entry = counts[op] = [0, 0, 0, 0.0]
    return entry


def count_call(op: str) -> None:
    """Count one call of ``op`` (fast path and staged alike), in one frame."""
    entry = _LOCAL.counts.get(op)
    if entry is None:
        entry = thread_counter(op)
    entry[0] += 1


def count_staging(op: str, nbytes: int, seconds: float, *, new_call: bool) -> None:
    """Add staging traffic and time to ``op``; ``new_call`` counts a staged call."""
    entry = thread_counter(op)
    entry[1] += new_call
    entry[2] += nbytes
    entry[3] += seconds


def log_first_staging(op: str, group_id: int, reason: str, message: str) -> None:
    """Log ``message`` at INFO the first time ``op`` stages for ``reason`` on a group."""
    key = (op, group_id, reason)
    if key in _LOGGED:
        return
    with _LOGGED_LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    logger.info("%s", message)


def stats() -> Dict[str, Dict[str, float]]:
    """Per collective: ``calls``, ``staged_calls``, ``bytes_staged`` and ``staging_seconds``.

    Summed over all threads since the start or the last :func:`reset_stats`.
    """
    totals: Dict[str, List[float]] = {}
    with _REGISTRY_LOCK:
        for counts in _REGISTRY:
            for op, entry in list(counts.items()):
                if not any(entry):
                    continue
                total = totals.setdefault(op, [0, 0, 0, 0.0])
                for i, value in enumerate(entry):
                    total[i] += value
    return {op: dict(zip(_FIELDS, values)) for op, values in sorted(totals.items())}


def reset_stats() -> None:
    """Zero every counter and forget which stagings were logged."""
    with _REGISTRY_LOCK:
        for counts in _REGISTRY:
            for entry in counts.values():
                entry[:] = [0, 0, 0, 0.0]
    with _LOGGED_LOCK:
        _LOGGED.clear()
