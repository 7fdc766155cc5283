"""``python -m comm.build``: build comm's C++ extensions ahead of time.

On a cluster, run it once per machine image (or shared cache folder) before a job:
otherwise each rank of the first job compiles the staging backend at its first use
(about a minute on 2 cores), and the ranks wait for each other on the build's lock.
``--simulated`` also builds the simulated accelerator (for tests and CI).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from comm._native import SIMULATED, STAGING, Extension


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comm.build", description=__doc__.splitlines()[0])
    parser.add_argument("--simulated", action="store_true", help="also build the simulated accelerator")
    args = parser.parse_args(argv)
    extensions: List[Extension] = [STAGING, SIMULATED] if args.simulated else [STAGING]
    failed = False
    for extension in extensions:
        reason = extension.unavailable_reason()
        if reason is not None:
            print(f"{extension.what}: cannot build: {reason}", file=sys.stderr)
            failed = True
            continue
        already = extension.is_built()
        extension.load()
        print(f"{extension.what}: {'already built' if already else 'built'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
