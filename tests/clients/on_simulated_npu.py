"""Runs a client script on the simulated NPU without comm's patch: what the script meets on Ascend without comm.

    torchrun --nproc-per-node 2 tests/clients/on_simulated_npu.py script.py [args...]

The simulated NPU (a device, its hccl backend and a stand-in ``torch_npu``) is set up
first, as installing torch_npu on an Ascend machine would; nothing of comm's
translation or staging is: the script then runs as ``python script.py`` would.
"""

import os
import runpy
import sys

from comm.testing import simulate_accelerator


def main() -> None:
    """Set the simulated NPU up, then run the script named first as ``__main__`` with the arguments after it."""
    simulate_accelerator("npu", "hccl")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
