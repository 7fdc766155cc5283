"""Runs PyTorch's own DistributedTest cases (shipped in the torch wheel) for c10d's calls, and reports them as JSON.

    BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=... STATS_DIR=... COMM_PATCH=1 python tests/torch_suite.py [SHARD COUNT]

The cases are every DistributedTest case named for a collective, a point-to-point
call or barrier, less those for CUDA, NCCL and DDP, plus the GPU-only cases of
:data:`NEED_GPUS`, which torch skips on a CPU-only machine and must skip under comm
too. Each case forks WORLD_SIZE ranks from this process, which imported ``comm``: with ``COMM_PATCH=1`` every rank runs
torch's test patched. Each rank writes to STATS_DIR whether it was patched.
With SHARD and COUNT it runs every COUNT-th case from the SHARD-th (cases mostly
wait on each other's ranks, so shards run side by side well).
torch's module reads BACKEND, WORLD_SIZE and TEMP_DIR when imported.
"""

import json
import os
import re
import sys
import unittest

import torch.multiprocessing
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

import comm  # COMM_PATCH=1 patches torch here, in this process and in every rank forked from it

CALLS = re.compile(r"all_reduce|broadcast|all_gather|reduce|gather|scatter|all_to_all|barrier|send|recv")
NOT_ON_GLOO = re.compile(r"cuda|nccl|ddp|hook|accumulate|monitored")
# Cases that need one GPU per rank (skip_if_lt_x_gpu) and run on gloo where there are GPUs: without one,
# torch skips them; comm's translation once told torch's helpers there were GPUs, and they failed on the CPU.
NEED_GPUS = ("test_monitored_barrier_allreduce_hang", "test_monitored_barrier_allreduce_hang_wait_all_ranks")


class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    """torch's DistributedTest cases, each run in freshly forked ranks."""

    def setUp(self) -> None:
        super().setUp()
        # Forked, not spawned as torch's CI does: a spawned rank re-imports torch, its test module and comm
        # (about 7 s here) for every case; a forked one inherits them, already patched.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def run_test(self, test_name, parent_pipe):
        path = os.path.join(os.environ["STATS_DIR"], f"{test_name}.{self.rank}.json")
        with open(path, "w") as out:
            json.dump({"patched": comm.is_patched()}, out)
        super().run_test(test_name, parent_pipe)


def case_names():
    """The DistributedTest cases for c10d's calls that can run on gloo, and those of :data:`NEED_GPUS`."""
    return [name for name in dir(DistributedTest._DistTestBase)
            if name.startswith("test_") and (CALLS.search(name) and not NOT_ON_GLOO.search(name) or name in NEED_GPUS)]


def main(shard, count):
    names = case_names()[shard::count]
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(
        unittest.TestSuite(TorchSuite(name) for name in names))
    failed = {test.id().split(".")[-1] for test, _ in result.failures + result.errors}
    skipped = {test.id().split(".")[-1]: reason for test, reason in result.skipped}
    report = {"ran": sorted(names), "failures": sorted(failed), "skipped": skipped,
              "need_gpus": sorted(set(names) & set(NEED_GPUS)),
              "passed": sorted(set(names) - failed - set(skipped))}
    print(json.dumps(report))


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3] or (0, 1)))
