"""comm._interpreter_exit: a process under the drop-in mode exits cleanly while gloo's worker waits for the lock."""

import inspect
from pathlib import Path

import pytest
import torch.autograd.graph
from test_examples import _torchrun

from comm import _interpreter_exit

pytestmark = pytest.mark.integration  # the integration tier: make test-integration

SCRIPT = str(Path(__file__).with_name("collective_left_running.py"))
ABORT = "terminate called without an active exception"


def _backward_stashes_a_python_object() -> bool:
    """Whether this torch keeps a Python object in the thread-local state of calls made during backward."""
    return "_stash_obj_in_tls" in inspect.getsource(torch.autograd.graph)


# Plain runs made, at the most, to see torch's abort: on 2.13 every run aborts; on 2.15.0 about one in
# three (4 of 12 here), so 16 miss it together about once in 600 suites.
PLAIN_TRIES = 16


def _first_abort() -> object:
    """The first of up to PLAIN_TRIES plain runs that aborted, or the last run where none did."""
    for _ in range(PLAIN_TRIES):
        plain = _torchrun("--standalone", "--nproc-per-node", "2", SCRIPT)
        if plain.returncode != 0:
            break
    return plain


def test_a_collective_left_running_at_exit_aborts_plainly_and_ends_cleanly_under_comm():
    if _backward_stashes_a_python_object():  # torch 2.13 on
        plain = _first_abort()
        assert plain.returncode != 0 and ABORT in plain.stderr, plain.stderr
    else:
        plain = _torchrun("--standalone", "--nproc-per-node", "2", SCRIPT)
        assert plain.returncode == 0, plain.stderr
    for _ in range(3):
        under_comm = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "comm", SCRIPT)
        assert under_comm.returncode == 0, under_comm.stderr
        assert ABORT not in under_comm.stderr


def test_the_handler_is_registered_once(monkeypatch):
    registered = []
    monkeypatch.setattr(_interpreter_exit, "_registered", False)
    monkeypatch.setattr(_interpreter_exit.atexit, "register", registered.append)
    for _ in range(3):
        _interpreter_exit.hand_over_at_exit()
    assert registered == [_interpreter_exit._hand_over_the_interpreter_lock]
