"""Observability: how often each collective ran, and what staging cost.

Calls are counted by one counter per collective, shared by all threads, whose
increment is a single C call: the fast path counts without a lock or a
thread-local lookup. Staging figures are kept per thread and summed on read.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable, Dict, List, Set, Tuple

__all__ = ["reset_stats", "stats"]

logger = logging.getLogger("comm")

_FIELDS = ("calls", "staged_calls", "bytes_staged", "staging_seconds")


class _CallCounter:
    """How many times one collective was called, from any thread.

    ``increment`` is ``next`` of an ``itertools.count``: one C call, atomic under
    the GIL and thread-safe in free-threaded builds (CPython gh-117657).
    """

    def __init__(self) -> None:
        self._count = itertools.count()
        self.increment: Callable[[], int] = self._count.__next__
        self._zero = 0

    def value(self) -> int:
        """Calls since the last reset; itertools.count shows only in its repr, ``count(N)``."""
        return int(repr(self._count)[len("count("):-1]) - self._zero

    def reset(self) -> None:
        self._zero += self.value()


class _ThreadCounters(threading.local):
    def __init__(self) -> None:
        self.counts: Dict[str, List[float]] = {}
        with _REGISTRY_LOCK:
            _REGISTRY.append(self.counts)


_REGISTRY_LOCK = threading.Lock()
_REGISTRY: List[Dict[str, List[float]]] = []
_LOCAL = _ThreadCounters()
_CALLS_LOCK = threading.Lock()
_CALLS: Dict[str, _CallCounter] = {}
_LOGGED_LOCK = threading.Lock()
_LOGGED: Set[Tuple[str, int, str]] = set()


def call_counter(op: str) -> Callable[[], int]:
    """What to call to count one call of ``op``; the fast path holds on to it."""
    counter = _CALLS.get(op)
    if counter is None:
        with _CALLS_LOCK:
            counter = _CALLS.setdefault(op, _CallCounter())
    return counter.increment


def count_call(op: str) -> None:
    """Count one call of ``op`` (fast path and staged alike)."""
    call_counter(op)()


def count_staging(op: str, nbytes: int, seconds: float, *, new_call: bool) -> None:
    """Add staging traffic and time to ``op``; ``new_call`` counts a staged call."""
    counts = _LOCAL.counts
    entry = counts.get(op)
    if entry is None:
        entry = counts[op] = [0, 0, 0.0]
    entry[0] += new_call
    entry[1] += nbytes
    entry[2] += seconds


def log_first_staging(op: str, group_id: int, reason: str, message: Callable[[], str]) -> None:
    """Log ``message()`` at INFO the first time ``op`` stages for ``reason`` on a group.

    The message is built only then: staging must not pay for formatting on every call.
    """
    key = (op, group_id, reason)
    if key in _LOGGED:
        return
    with _LOGGED_LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    logger.info("%s", message())


def stats() -> Dict[str, Dict[str, float]]:
    """Per collective: ``calls``, ``staged_calls``, ``bytes_staged`` and ``staging_seconds``.

    Summed over all threads since the start or the last :func:`reset_stats`.
    """
    totals: Dict[str, List[float]] = {}
    for op, counter in list(_CALLS.items()):
        calls = counter.value()
        if calls:
            totals[op] = [calls, 0, 0, 0.0]
    with _REGISTRY_LOCK:
        for counts in _REGISTRY:
            for op, entry in list(counts.items()):
                total = totals.setdefault(op, [0, 0, 0, 0.0])
                for i, value in enumerate(entry, start=1):
                    total[i] += value
    return {op: dict(zip(_FIELDS, values)) for op, values in sorted(totals.items())}


def reset_stats() -> None:
    """Zero every counter and forget which stagings were logged."""
    with _CALLS_LOCK:
        for counter in _CALLS.values():
            counter.reset()
    with _REGISTRY_LOCK:
        for counts in _REGISTRY:
            counts.clear()
    with _LOGGED_LOCK:
        _LOGGED.clear()
