"""Work handles comm returns in place of torch's: a call comm finishes in Python (staged
without the native backend, AVG divided, uneven pieces copied out), which does so
when waited on, and a profiled call's, which tells comm.profile() when it completed."""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Protocol, Sequence

import torch
import torch.distributed as dist


class DeferredWork(dist.Work):
    """The work handle of a collective ``comm`` must finish: copy back, divide for AVG.

    A ``torch.distributed.Work``, as torch's own calls return: ``wait()`` waits
    and then writes the results into the caller's tensors (and raises what the
    collective or the write-back raised); ``is_completed()`` is True only once
    they are there; ``get_future()`` completes after the write-back. Being a c10d
    work, it can stand behind a functional collective's ``wait_tensor``.

    It must hold no reference to the process group: ``get_future()``'s callback
    runs on a backend thread, and if that thread dropped the group's last
    reference, the group's destructor would join the thread it runs on (gloo
    aborts with "Resource deadlock avoided").
    """

    def __init__(self, works: Sequence[Any], finish: Callable[[], None], outputs: List[torch.Tensor]) -> None:
        super().__init__()
        self._works = list(works)
        self._finish = finish
        self._outputs = outputs
        self._lock = threading.Lock()
        self._finished = False

    def wait(self, timeout: Optional[Any] = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        self._finish_once()
        return True

    def is_completed(self) -> bool:
        if not all(work.is_completed() for work in self._works):
            return False
        if all(work.is_success() for work in self._works):
            self._finish_once()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and all(work.is_success() for work in self._works)

    def exception(self) -> Optional[BaseException]:
        for work in self._works:
            error: Optional[BaseException] = work.exception()
            if error is not None:
                return error
        return None

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future[List[torch.Tensor]]:
        """A future that completes once the results are written back."""
        inner = torch.futures.collect_all([_future_of(work) for work in self._works])
        return inner.then(self._finish_future)

    def _source_rank(self) -> int:
        """The sender of a receive from any source (``irecv`` with ``src=None``), as torch's work says."""
        source: int = self._works[0]._source_rank()
        return source

    def _finish_future(self, done: torch.futures.Future[List[torch.futures.Future[Any]]]) -> List[torch.Tensor]:
        for future in done.value():
            future.value()  # re-raises the collective's error
        self._finish_once()
        return self._outputs

    def _finish_once(self) -> None:
        with self._lock:
            if not self._finished:
                self._finish()
                self._finished = True


def _future_of(work: Any) -> torch.futures.Future[Any]:
    """``work``'s future; where the backend gives its work none (gloo's reduce-scatter), a completed one, after
    waiting for the work (or holding its error)."""
    try:
        future: torch.futures.Future[Any] = work.get_future()
        return future
    except RuntimeError as missing:
        if "not implemented" not in str(missing):
            raise
    done: torch.futures.Future[Any] = torch.futures.Future()
    try:
        work.wait()
    except BaseException as error:  # noqa: BLE001 - the future carries it to whoever waits
        done.set_exception(error)
    else:
        done.set_result(None)
    return done


class TimedCall(Protocol):
    """A call comm.profile() is timing: told when each of its works is seen complete, and what to file it under."""

    ends_on_completion: bool  # whether seeing it complete ends it, or only wait() (device clocks)

    def one_done(self) -> None: ...


_TIMED_LOCK = threading.Lock()


class TimedWork(dist.Work):
    """The work handle of a call comm.profile() times: the call ends when ``wait()`` returns.

    Where seeing it complete ends it too (the host clock), so do ``is_completed()``
    returning True and the completion of ``get_future()``'s future. A
    ``torch.distributed.Work`` like the handle it wraps, whose answers it gives.
    """

    def __init__(self, work: Any, call: TimedCall) -> None:
        super().__init__()
        self._work = work
        self._call: Optional[TimedCall] = call

    def wait(self, *timeout: Any) -> Any:
        done = self._work.wait(*timeout)
        self._done()
        return done

    def is_completed(self) -> bool:
        completed = bool(self._work.is_completed())
        if completed and self._ends_on_completion():
            self._done()
        return completed

    def get_future(self) -> Any:
        future = self._work.get_future()
        if not self._ends_on_completion():
            return future

        def finished(done: Any) -> Any:
            value = done.value()  # re-raises the collective's error: a failed call is not timed
            self._done()
            return value

        return future.then(finished)  # completes once the call is recorded

    # What torch's Work defines itself, so the wrapped handle must answer explicitly.
    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.result()

    def source_rank(self) -> int:
        return int(self._work.source_rank())

    def _source_rank(self) -> int:
        return int(self._work._source_rank())

    def synchronize(self) -> None:
        self._work.synchronize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def _ends_on_completion(self) -> bool:
        call = self._call
        return call is not None and call.ends_on_completion

    def _done(self) -> None:
        with _TIMED_LOCK:
            call, self._call = self._call, None
        if call is not None:
            call.one_done()
