"""``python -m comm.testing.cann``: run a script or module on the installed torch_npu over comm's fake CANN.

    python -m comm.testing.cann script.py [args...]
    python -m comm.testing.cann -m package.module [args...]
    torchrun --nproc-per-node 2 -m comm.testing.cann script.py

Without comm: the control for ``python -m comm --simulate cann``. The fake was loaded when
``import comm`` ran (comm._cann_boot); every process the script starts loads it too.
"""

from __future__ import annotations

import sys

from comm.__main__ import check_target, run_target
from comm.testing.cann import require_torch_npu


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    check_target("python -m comm.testing.cann", args)
    require_torch_npu()
    run_target(args)


if __name__ == "__main__":
    main()
