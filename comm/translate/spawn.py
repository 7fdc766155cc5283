"""Children of a patched process run patched: ``torch.multiprocessing.spawn`` and ``multiprocessing``'s spawn.

A spawned child is a fresh interpreter that imports the parent's script but not what
patched the parent, so a tutorial's ``mp.spawn(main, nprocs=...)`` under ``python -m
comm`` would run its ranks on plain torch. While patched, the command line
``multiprocessing`` builds for a spawned child first imports comm and patches it the
way this process is patched (device translation as here), before the
child loads the parent's ``__main__`` or unpickles its target. ``COMM_SIMULATE`` in
the environment (``python -m comm --simulate npu``) sets up the simulated accelerator
in the child at that import, as in the parent.
"""

from __future__ import annotations

import multiprocessing.spawn
from typing import Any, List

from comm import translate

__all__ = ["get_command_line"]

_ORIGINAL = multiprocessing.spawn.get_command_line


def get_command_line(**kwargs: Any) -> List[str]:
    """``multiprocessing.spawn.get_command_line``, with comm's patch run first in the child."""
    line: List[str] = _ORIGINAL(**kwargs)
    if "-c" not in line:  # a frozen executable: nothing to prefix
        return line
    position = line.index("-c") + 1
    line[position] = _prelude() + line[position]
    return line


def _prelude() -> str:
    devices = translate.is_installed()
    return ("import importlib.util\n"
            "if importlib.util.find_spec('comm') is not None:\n"
            f"    import comm; comm.patch(devices={devices})\n")
