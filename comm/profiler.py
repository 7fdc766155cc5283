"""Profiling: how long each collective took, at what size and bandwidth, and what staging cost.

``with comm.profile() as prof:`` times every collective and point-to-point call
made inside the block through ``torch.distributed``'s functions or comm's, from any
thread, sync and async; and it reports what comm's staging backend staged in the
block, whatever road the calls came by (:func:`comm.stats`, over the block).
``prof.summary()`` is a plain-text table and ``prof.to_dict()`` the figures, per
collective and per power-of-two message size, with bus bandwidth by the nccl-tests
formulas (:mod:`comm._profile_figures`).

It costs nothing when off. While a profile is open, ``torch.distributed``'s
functions are timing wrappers of torch's own, recorded in comm's one ledger of
replacements (:mod:`comm._ledger`), and comm's explicit calls run the same wrappers
(:func:`comm.collectives.retarget`); when the last one closes they are torch's again,
except where someone replaced a wrapper in the meantime (theirs stays).
Calls torch makes from C++ (DDP's reducer) or through functional collectives
(DTensor, compiled code), and functions imported by name before the block opened,
are not timed; their staging is still counted.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import sys
import threading
import time
from types import TracebackType
from typing import Any, Callable, Dict, Optional, Tuple, Type

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from comm import _ledger, collectives, observability
from comm._env import env_switch
from comm._profile_figures import Measured, collective_dict, message, summary_table
from comm.launch import launch_info
from comm.work import TimedWork

__all__ = ["Profile", "is_profiling", "profile"]

# Each timed function's parameters, in order: torch.distributed's signatures.
_SIGNATURES: Dict[str, Tuple[str, ...]] = {
    name: tuple(inspect.signature(function).parameters) for name, function in collectives.TORCH.items()
}


def _a_tensor(name: str, arguments: Dict[str, Any]) -> Optional[torch.Tensor]:
    """A tensor of the call, from its message: the device it runs on, which chooses the clock."""
    argument = collectives.COLLECTIVES[name].message
    if argument is None:
        return None
    value: Any = arguments[argument]
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    tensor: Optional[torch.Tensor] = getattr(value, "tensor", value)  # a P2POp holds its tensor
    return tensor


def _group_size(name: str, arguments: Dict[str, Any]) -> int:
    group: Any = arguments["p2p_op_list"][0].group if name == "batch_isend_irecv" else arguments.get("group")
    if group is None:
        group = dist.group.WORLD
    return int(group.size())


class _HostClock:
    """time.perf_counter: for devices where a call's return (or its wait's) means it has completed."""

    label = "host"

    def start(self) -> Any:
        return time.perf_counter()

    def elapsed(self, started: Any) -> Any:
        return time.perf_counter() - started


class _EventClock:
    """Timing events on the device's current stream, read later: the host returns before the device finishes."""

    def __init__(self, module: Any, device: torch.device) -> None:
        self._module = module
        self._device = device
        self.label = f"{device.type} events"

    def start(self) -> Any:
        event = self._module.Event(enable_timing=True)
        event.record(self._module.current_stream(self._device))
        return event

    def elapsed(self, started: Any) -> Any:
        return (started, self.start())  # a pair of events: reading their interval waits for the device


_HOST = _HostClock()
_EVENT_MODULES: Dict[str, Optional[Any]] = {}  # device type -> its torch module, where its events can time


def _clock(tensor: Optional[torch.Tensor]) -> Optional[Any]:
    """How to time a call on ``tensor``'s device; None while that device's stream is captured into a graph."""
    if tensor is None or tensor.is_cpu:
        return _HOST
    kind = tensor.device.type
    if kind not in _EVENT_MODULES:
        _EVENT_MODULES[kind] = None if kind == "meta" else _timing_events(kind)
    module = _EVENT_MODULES[kind]
    if module is None:
        return _HOST
    capturing = getattr(module, "is_current_stream_capturing", None)
    if capturing is not None and capturing():
        return None
    return _EventClock(module, tensor.device)


def _timing_events(kind: str) -> Optional[Any]:
    """The device's torch module if its events can time work, else None (the host clock times it)."""
    module = getattr(torch, kind, None)
    try:
        first, second = module.Event(enable_timing=True), module.Event(enable_timing=True)  # type: ignore[union-attr]
        first.record()
        second.record()
        second.synchronize()
        first.elapsed_time(second)
    except Exception:  # noqa: BLE001 - whatever fails, this device's events cannot time
        return None
    return module


class _Inside(threading.local):
    depth = 0  # inside a timed call on this thread: calls it makes (torch's batch, a patched isend) are its own


_INSIDE = _Inside()
_DONE_LOCK = threading.Lock()


class _Call:
    """One timed collective: torch's function and its arguments, its clock and start, the profiles it goes to.

    ``name`` is the comm call it is filed under; ``function`` (torch's) says what the message is.
    """

    def __init__(self, function: str, arguments: Dict[str, Any], profiles: Tuple["Profile", ...], clock: Any,
                 started: Any) -> None:
        self.name = self.function = function
        self.clock = clock
        self.ends_on_completion = clock is _HOST  # on a device clock, only wait() ends a call
        self._arguments = arguments
        self._profiles = profiles
        self._started = started
        self._remaining = 0

    def track(self, result: Any) -> Any:
        """What an async call returns: its work (or list of works) timed until each is seen complete."""
        works = result if isinstance(result, list) else [result]
        self._remaining = len(works)
        for profile in self._profiles:
            profile._pending_change(self.name, 1)
        timed = [TimedWork(work, self) for work in works]
        if not works:
            self.one_done()
        return timed if isinstance(result, list) else timed[0]

    def one_done(self) -> None:
        with _DONE_LOCK:
            self._remaining -= 1
            if self._remaining > 0:
                return
        for profile in self._profiles:
            profile._pending_change(self.name, -1)
        _file(self._profiles, self.name, self.function, self._arguments, self.clock.elapsed(self._started),
              self.clock.label)


def _file(profiles: Tuple["Profile", ...], name: str, function: str, arguments: Dict[str, Any], elapsed: Any,
          clock: str) -> None:
    """Record a finished call of torch's ``function`` under comm's ``name`` in ``profiles``."""
    nbytes, bus = message(function, arguments, _group_size(function, arguments))
    for profile in profiles:
        profile._record(name, nbytes, bus, elapsed, clock)


def _timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (torch's function ``name``), timed into every open profile."""
    params = _SIGNATURES[name]
    always_async = collectives.COLLECTIVES[name].always_async

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        profiles = _ACTIVE
        if not profiles or _INSIDE.depth:
            return original(*args, **kwargs)
        arguments = dict(zip(params, args))
        if kwargs:
            arguments.update(kwargs)
        clock = _clock(_a_tensor(name, arguments))
        if clock is None:
            return original(*args, **kwargs)
        _INSIDE.depth += 1
        try:
            started = clock.start()
            result = original(*args, **kwargs)
            elapsed = None if always_async or arguments.get("async_op") else clock.elapsed(started)
        finally:
            _INSIDE.depth -= 1
        if elapsed is not None:
            _file(profiles, name, name, arguments, elapsed, clock.label)
            return result
        return None if result is None else _Call(name, arguments, profiles, clock, started).track(result)

    return timed


class Profile:
    """What one ``comm.profile()`` block measured: read it with :meth:`summary` or :meth:`to_dict`.

    It records calls issued while it is open and completed before it closes (an
    async call counts when its ``wait()`` returns); readable inside the block too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "new"
        self._measured = Measured()
        self._staged_before: Dict[str, Dict[str, float]] = {}
        self._staged_after: Optional[Dict[str, Dict[str, float]]] = None
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None

    def __enter__(self) -> "Profile":
        _open(self)
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        _close(self)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Per collective: ``calls``, ``bytes``, ``seconds``, ``mean_seconds``, ``max_seconds``,
        ``algbw_gbps``, ``busbw_gbps``, ``staged_calls``, ``staged_bytes``, ``staged_seconds``,
        ``pending`` (async calls not yet seen complete) and ``sizes``, the same per message size."""
        with self._lock:
            self._fill_staging()
            return collective_dict(self._measured)

    def summary(self) -> str:
        """A plain-text table: one row per collective and message size, then what staging copied."""
        with self._lock:
            self._fill_staging()
            return summary_table(self._measured, self.rank, self.world_size)

    def _fill_staging(self) -> None:
        """What was staged while the block was open: comm.stats() at its end (or now) less at its start."""
        after = observability.stats() if self._staged_after is None else self._staged_after
        self._measured.staging = {}
        for op, figures in after.items():
            before = self._staged_before.get(op, {})
            calls, nbytes, seconds = (figures[key] - before.get(key, 0)
                                      for key in ("staged_calls", "bytes_staged", "staging_seconds"))
            if calls or nbytes:
                self._measured.staging[op] = [calls, nbytes, seconds]

    def _record(self, name: str, nbytes: int, bus: float, elapsed: Any, clock: str) -> None:
        with self._lock:
            if self._state != "open":
                return
            if self.rank is None and dist.is_initialized():
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._measured.record(name, nbytes, bus, elapsed, clock)

    def _pending_change(self, name: str, change: int) -> None:
        with self._lock:
            if self._state == "open":
                pending = self._measured.pending
                pending[name] = pending.get(name, 0) + change
                if not pending[name]:
                    del pending[name]


def profile() -> Profile:
    """A context manager that times every comm collective and point-to-point call made inside it.

    ``with comm.profile() as prof: ...`` then ``print(prof.summary())``. Blocks nest
    (each sees the calls made while it is open) and see calls from every thread.
    """
    return Profile()


_LOCK = threading.Lock()
_ACTIVE: Tuple[Profile, ...] = ()  # replaced whole: a reader never sees half of it
# Who holds the timing wrappers in comm's ledger (comm._ledger).
_BY = "comm.profile()"
# What comm's explicit calls ran before the open profile retargeted them: torch's functions.
_RETARGETED: Dict[str, Callable[..., Any]] = {}


def is_profiling() -> bool:
    """Whether a ``comm.profile()`` block is open in this process: while one is, torch's functions are timed.

    For tests and tools that must know profiling is off (torch's functions are then torch's own).
    """
    return bool(_ACTIVE)


def _open(block: Profile) -> None:
    global _ACTIVE
    with _LOCK:
        if block._state != "new":
            raise RuntimeError("this profile has already recorded a block; call comm.profile() for another")
        if not _ACTIVE:
            _install()
        with block._lock:
            block._state = "open"
            block._staged_before = observability.stats()
        _ACTIVE = (*_ACTIVE, block)


def _close(block: Profile) -> None:
    global _ACTIVE
    with _LOCK:
        with block._lock:
            block._state = "closed"
            block._staged_after = observability.stats()
        _ACTIVE = tuple(other for other in _ACTIVE if other is not block)
        if not _ACTIVE:
            _ledger.restore(by=_BY)
            for name, original in _RETARGETED.items():
                collectives.retarget(name, original)
            _RETARGETED.clear()


def _install() -> None:
    """Put timing wrappers of torch's functions where torch.distributed and comm's calls look them up."""
    # One timing wrapper per function, wherever it is held: torch compares functions by
    # identity (P2POp's op against distributed_c10d.isend).
    timed: Dict[int, Callable[..., Any]] = {}
    for module in (dist, c10d):
        for name in _SIGNATURES:
            if name in vars(module):
                original = vars(module)[name]
                _ledger.replace(module, name, timed.setdefault(id(original), _timed(name, original)), by=_BY)
    for name, original in collectives.TORCH.items():
        _RETARGETED[name] = collectives.retarget(name, timed.setdefault(id(original), _timed(name, original)))


def profile_if_asked() -> None:
    """``COMM_PROFILE=1``: profile the whole process, print the table to stderr at exit (rank 0; ``all``: all)."""
    mode = env_switch("COMM_PROFILE", "1 (rank 0 prints the profile at exit), all (every rank does) or 0",
                      also=("all",))
    if mode == "off":
        return
    whole = profile()
    whole.__enter__()
    atexit.register(_print_at_exit, whole, mode == "all")


def _print_at_exit(whole: Profile, every_rank: bool) -> None:
    whole.__exit__(None, None, None)
    rank = whole.rank
    if rank is None:
        try:
            rank = launch_info().rank
        except ValueError:
            rank = 0
    if every_rank or rank == 0:
        print(whole.summary(), file=sys.stderr, flush=True)
