"""Stop, by pid, whatever the launchers' tier started, once the tier is done or dead.

    python reaper.py     (started by conftest.py, its stdin a pipe from pytest)

Each line pytest writes to its stdin is a marker, ``NAME=VALUE``: every process the
tier starts carries ``COMM_LAUNCHERS_TIER=<this run's token>`` in its environment, and
each Slurm step's slurmstepd (which slurmd starts with an environment of its own)
carries ``SLURM_CONF=<this run's slurm.conf>``. When its stdin closes, because the tier
ended or because pytest was killed outright, this sends SIGTERM to each live process
whose environment holds one of the markers exactly, gives them 3 s, SIGKILLs what is
left, and prints how many it found. No other process is touched.
"""

import os
import signal
import sys
import time
from typing import List, Set


def carrying(markers: Set[bytes]) -> List[int]:
    """The pids of this machine's processes whose environment holds one of ``markers``, but this one."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if markers.intersection(environ.read().split(b"\0")):
                    found.append(int(entry))
        except OSError:  # gone, or a zombie
            continue
    return found


def signal_all(pids: List[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main() -> None:
    markers = {line.strip().encode() for line in sys.stdin if "=" in line}  # until the tier closes the pipe, or dies
    left = carrying(markers)
    stopped = len(left)
    signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + 3
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = carrying(markers)
    for _ in range(5):  # what forked meanwhile is killed too
        if not left:
            break
        signal_all(left, signal.SIGKILL)
        time.sleep(0.2)
        left = carrying(markers)
    print(f"reaper: {stopped} process(es) of this run were still alive; {len(left)} left", flush=True)


if __name__ == "__main__":
    main()
