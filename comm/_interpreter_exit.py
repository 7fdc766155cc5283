"""At interpreter exit, c10d's worker threads get the interpreter lock once more before Python shuts down.

Gloo runs each collective on a worker thread of its own, and that thread often
holds the last reference to the collective's work object. The work keeps the
thread-local state of the call that issued it, and since torch 2.13 a call made
during backward carries a Python object there (``torch.autograd.graph``
stashes the ``contextvars`` context for the autograd engine's threads). So
destroying such a work takes the interpreter lock. A main thread that keeps the
lock busy can starve the worker until the interpreter starts finalizing; the
worker then wakes inside a C++ destructor, CPython ends the thread there, and
the process aborts: ``terminate called without an active exception``. A DDP
trainer on gloo that calls ``destroy_process_group()`` hits it about one run
in four on a 2-core machine, with or without comm (pytorch/pytorch#190489).

The drop-in mode runs other people's programs unchanged, so it ends them
cleanly: once a process has a process group, an exit handler releases the
lock for a moment. ``atexit`` handlers run while the interpreter is whole,
after Python's own threads have been joined; a worker waiting for the lock
takes it then, drops its work and goes back to waiting for the next one.
"""

from __future__ import annotations

import atexit
import threading
import time

# How long the exit handler leaves the interpreter lock free. A waiting thread
# takes the lock as soon as the scheduler runs it; 50 ms covers a loaded 2-core
# machine and costs the process nothing it would notice at exit.
HANDOVER_SECONDS = 0.05

_LOCK = threading.Lock()
_registered = False


def hand_over_at_exit() -> None:
    """Register, once per process, the exit handler that lets waiting worker threads finish first."""
    global _registered
    with _LOCK:
        if not _registered:
            atexit.register(_hand_over_the_interpreter_lock)
            _registered = True


def _hand_over_the_interpreter_lock() -> None:
    time.sleep(HANDOVER_SECONDS)  # sleeping releases the lock; a thread waiting for it runs now
