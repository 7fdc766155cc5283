"""Failures injected on purpose, for atomicity and fault tests.

``failure_problems`` is the check every atomicity test makes: a call whose
collectives fail (``comm.testing.fail_next``: the simulated backend's broken link)
raises the injected error, says what comm staged, and leaves the caller's tensors
as they were.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from comm.testing import FAILURE_MODES, fail_next

__all__ = ["FAILURE_MODES", "INJECTED", "LATE_PEER_SCENARIOS", "failure_problems", "late_peer"]

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


# ---- a late peer: how long a rank waits for one that never comes (issue 51) ----------------

# Each scenario: what rank 0 issues while rank 1, in the group, stays away. "served" runs the call on
# the group's own device (the oracle, torch alone); the others stage it under comm.
# "served_send" and "staged_send" are a send to the late peer in place of the all-reduce.
LATE_PEER_SCENARIOS = ("served", "staged", "staged_from_thread", "float64", "served_send", "staged_send")


def late_peer_rank(rank: int, store: str, backend: str, scenario: str, pg_timeout: float, late: float) -> None:
    """One rank of :func:`late_peer`: rank 1 joins the group, then stays away ``late`` seconds; rank 0 issues
    ``scenario``'s all-reduce and prints when it started and how it ended (if the process is not torn down)."""
    import datetime
    import threading
    import time

    import comm
    import comm.testing

    comm.testing.simulate_accelerator("npu", "hccl", device_count=2)
    comm.bind(rank)
    dist.init_process_group(backend, store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    if rank == 1:
        time.sleep(late)
        return
    served = "cpu" if backend == "gloo" else f"npu:{rank}"
    staged = f"npu:{rank}" if backend == "gloo" else "cpu"
    dtype = torch.float64 if scenario == "float64" else torch.float32
    tensor = torch.ones(4, dtype=dtype, device=served if scenario.startswith("served") else staged)
    outcome: List[str] = []

    def call() -> None:
        try:
            if scenario.endswith("send"):
                dist.send(tensor, dst=1)
                torch.accelerator.synchronize()  # a sender reads nothing back: its host waits for the device
            else:
                dist.all_reduce(tensor)
            tensor.cpu()  # the host waits for the collective, as a caller reading its result does
            outcome.append("returned")
        except Exception as error:  # noqa: BLE001 - reported to the parent
            outcome.append(f"raised {type(error).__name__}: {str(error).splitlines()[0]}")

    comm.equip()
    print(f"start {time.time()}", flush=True)
    if scenario == "staged_from_thread":  # as dcp.async_save's thread issues its collectives
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
    else:
        call()
    print(f"end {time.time()} {outcome[0]}", flush=True)


def late_peer(backend: str, scenario: str, pg_timeout: float, late: float, env: Optional[Dict[str, str]] = None,
              timeout: float = 120.0) -> Dict[str, Any]:
    """Rank 0's end when rank 1 is ``late`` seconds late to ``scenario``'s all-reduce, on two simulated NPUs.

    Returns ``{"seconds": from the call to rank 0's exit, "how": "raised ...", "returned" or "never returned",
    "exit": its exit code}``: a watchdog that tears the process down (HCCL's default) ends it with a non-zero
    code, whether or not the call returned first. Rank 0 exits as soon as its call has ended.
    """
    import os
    import subprocess
    import sys
    import tempfile
    import time

    with tempfile.TemporaryDirectory(prefix="comm-late-") as work:
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import faults; "
                f"faults.late_peer_rank(int(sys.argv[1]), {os.path.join(work, 'store')!r}, {backend!r}, "
                f"{scenario!r}, {pg_timeout!r}, {late!r})")
        ranks = [subprocess.Popen([sys.executable, "-c", code, str(rank)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
                 for rank in range(2)]
        try:
            out, err = ranks[0].communicate(timeout=timeout)
            ended = time.time()
        finally:
            for rank in ranks:
                rank.kill()
                rank.communicate()
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("start ", "end ")))
    if "start" not in lines:
        raise AssertionError(f"rank 0 never issued its call (exit {ranks[0].returncode}):\n{err[-3000:]}")
    how = lines["end"].split(" ", 1)[1] if "end" in lines else "never returned"
    return {"seconds": ended - float(lines["start"]), "how": how, "exit": ranks[0].returncode}
