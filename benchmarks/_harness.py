"""What every benchmark shares: ranks started in fresh processes, and single calls timed in rotating order."""

from __future__ import annotations

import glob
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

WARMUP = 50  # untimed rounds before timing

Call = Callable[[], Any]
# The libc function callgrind dumps its counts before: a process marks the end of each
# part it counts with one call of it (os.getppid, which nothing else here calls).
MARKER = "getppid"


def run_ranks(body: Callable[[int], Any], world_size: int = 2, backend: str = "gloo",
              simulate: Optional[Dict[str, Any]] = None) -> Any:
    """Run ``body(rank)`` on ``world_size`` fresh processes in a group; return rank 0's result."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as workdir:
        store = os.path.join(workdir, "store")
        ranks = [context.Process(target=_rank, args=(body, r, world_size, store, backend, simulate, results))
                 for r in range(world_size)]
        for process in ranks:
            process.start()
        result = results.get(timeout=900)
        for process in ranks:
            process.join()
    return result


def _rank(body: Callable[[int], Any], rank: int, world_size: int, store: str, backend: str,
          simulate: Optional[Dict[str, Any]], results: Any) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    if "OMP_NUM_THREADS" not in os.environ:
        # One CPU thread per rank for torch's kernels, as torchrun sets for several ranks on a machine
        # (and make bench does): with a pool of threads each, ranks outnumber the cores, a pool's idle
        # threads spin on them, and a 1 MiB copy took milliseconds instead of tens of microseconds.
        torch.set_num_threads(1)
    if simulate is not None:
        import comm
        import comm.testing

        comm.testing.simulate_accelerator(**simulate)
        comm.bind(rank)
    dist.init_process_group(backend, store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    result = body(rank)
    if rank == 0:
        results.put(result)
    dist.destroy_process_group()


def rotate(sides: Sequence[Call], calls: int, setups: Optional[Sequence[Call]] = None,
           warmup: int = WARMUP) -> List[float]:
    """Median seconds per call of each side, timed one call each per round in rotating order.

    The order rotates round by round, so drift and position effects hit every side
    alike. ``setups[i]``, where given, runs untimed before each call of side ``i``;
    ``warmup`` untimed rounds come first.
    """
    for _ in range(warmup):
        for side in sides:
            side()
    times: List[List[float]] = [[] for _ in sides]
    for index in range(calls):
        for offset in range(len(sides)):
            which = (index + offset) % len(sides)
            if setups is not None:
                setups[which]()
            start = time.perf_counter()
            sides[which]()
            times[which].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def marker() -> None:
    """Mark the end of a counted part of a process run by :func:`instructions_by_part`."""
    getattr(os, MARKER)()


def instructions_by_part(script: str, *args: str, parts: int, main_thread: bool = False) -> Optional[List[int]]:
    """The instructions of each part of ``python script args`` under callgrind (None where valgrind is not
    installed): the process calls :func:`marker` once before its first part and once after each of ``parts``.

    Every thread is counted (gloo runs collectives on threads of its own), or the main
    thread alone where ``main_thread``: with a peer process, gloo's threads spin while they
    wait for it, a count that depends on the peer's timing; the main thread runs all
    of Python's side of a call. The counts are exact for what ran; an A/A pair of parts
    shows how much that varies.
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as workdir:
        out = os.path.join(workdir, "callgrind.out")
        threads = ["--separate-threads=yes"] if main_thread else []
        subprocess.run([valgrind, "--tool=callgrind", *threads, f"--dump-before={MARKER}",
                        f"--callgrind-out-file={out}", sys.executable, script, *args],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
        # Dump 1 holds what ran up to the first marker, dumps 2.. the parts in order (the rest goes to ``out``).
        # With separate threads each dump is a file per thread, the main thread's ending in "-01".
        pattern, suffix = (out + ".*-01", "-01") if main_thread else (out + ".*", "")
        dumps = sorted(glob.glob(pattern), key=lambda path: int(path[:len(path) - len(suffix)].rsplit(".", 1)[1]))
        totals = [_total(path) for path in dumps]
    if len(totals) != parts + 1:
        raise RuntimeError(f"callgrind wrote {len(totals)} dumps, expected {parts + 1}")
    return totals[1:]


def _total(path: str) -> int:
    with open(path) as counts:
        for line in counts:
            found = re.match(r"(?:summary|totals):\s+(\d+)", line)
            if found:
                return int(found.group(1))
    raise RuntimeError(f"no instruction total in {path}")
