"""Runs cases of PyTorch's own DistributedTest (shipped in the torch wheel) and reports them as JSON.

    BACKEND=gloo WORLD_SIZE=3 TEMP_DIR=... STATS_DIR=... COMM_PATCH=1 python tests/torch_suite.py test_gather ...

Each case spawns WORLD_SIZE fresh interpreters that import this file, and with it
``comm``: with ``COMM_PATCH=1`` every rank runs torch's test against comm's
patched functions. Each rank writes what ``comm.stats()`` counted during the case
to STATS_DIR, so the caller can tell that comm's wrappers carried the calls.
torch's module reads BACKEND, WORLD_SIZE and TEMP_DIR when imported.
"""

import json
import os
import sys
import unittest

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

import comm  # COMM_PATCH=1 patches torch here, in this process and in every spawned rank


class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    """torch's DistributedTest cases, each run in freshly spawned ranks (as torch's own CI runs them)."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def run_test(self, test_name, parent_pipe):
        comm.reset_stats()
        try:
            super().run_test(test_name, parent_pipe)
        finally:
            path = os.path.join(os.environ["STATS_DIR"], f"{test_name}.{self.rank}.json")
            with open(path, "w") as out:
                json.dump({"patched": comm.is_patched(), "stats": comm.stats()}, out)


def main(names):
    suite = unittest.TestSuite(TorchSuite(name) for name in names)
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
    report = {
        "ran": result.testsRun,
        "failures": [test.id() for test, _ in result.failures + result.errors],
        "skipped": [test.id() for test, _ in result.skipped],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
