"""What every benchmark shares: ranks started in fresh processes, and single calls timed in rotating order."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

WARMUP = 50  # untimed rounds before timing

Call = Callable[[], Any]


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


def rotate(sides: Sequence[Call], calls: int, setups: Optional[Sequence[Call]] = None) -> List[float]:
    """Median seconds per call of each side, timed one call each per round in rotating order.

    The order rotates round by round, so drift and position effects hit every side
    alike. ``setups[i]``, where given, runs untimed before each call of side ``i``.
    """
    for _ in range(WARMUP):
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
