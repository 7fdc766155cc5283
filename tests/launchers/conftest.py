"""The real-launcher tier's machinery: the packages, one Slurm cluster per session, each launch's time.

`make test-launchers` runs this folder (pyproject.toml keeps it out of every other tier).
"""

import signal
import subprocess
import sys
from typing import Callable, Iterator

import pytest
from launcher_harness import (
    NOTES,
    REAPER,
    REAPER_VARIABLE,
    TIMINGS,
    TOKEN,
    SlurmCluster,
    install,
    missing_commands,
    versions,
    why_not_installable,
)


@pytest.fixture(scope="session", autouse=True)
def reaper() -> Iterator[Callable[[str], None]]:
    """reaper.py, for the whole session: when pytest ends, or is killed, it stops by pid every process the tier
    started that is still alive (normally none: each test waits for its own). Yields ``watch(marker)``, which adds
    an environment entry that marks such a process; this run's token is the first."""
    process = subprocess.Popen([sys.executable, str(REAPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    pipe = process.stdin
    assert pipe is not None

    def watch(marker: str) -> None:
        pipe.write(marker + "\n")
        pipe.flush()

    watch(f"{REAPER_VARIABLE}={TOKEN}")
    # A SIGTERM to pytest (a CI timeout) becomes a KeyboardInterrupt, so that pytest still tears the session down.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGTERM, previous)
        out, _ = process.communicate(timeout=60)
        NOTES.append(out.strip())


@pytest.fixture(scope="session")
def launchers_installed() -> None:
    """OpenMPI, MPICH, Slurm and munge: installed now where missing, else the tier skips, saying why."""
    if not missing_commands():
        NOTES.append("packages already installed:\n" + versions())
        return
    reason = why_not_installable()
    if reason is not None:
        pytest.skip(reason)
    seconds, _ = install()
    NOTES.append(f"installed in {seconds:.1f} s (tests/launchers/install.sh):\n" + versions())


@pytest.fixture(scope="session")
def slurm_cluster(launchers_installed: None, reaper: Callable[[str], None],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged, slurmctld and two slurmd in a folder of this session's, stopped by their pids at its end.

    Killed outright, pytest takes the daemons with it (each dies with its parent), and
    the reaper stops the rest: each Slurm step's slurmstepd carries this cluster's
    ``SLURM_CONF``.
    """
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    reaper(f"SLURM_CONF={cluster.conf}")
    try:
        seconds = cluster.start()
        NOTES.append(f"Slurm cluster (munged, slurmctld, 2 slurmd) up in {seconds:.1f} s in {cluster.folder}, "
                     f"first job id {cluster.first_job_id}")
        yield cluster
    finally:
        cluster.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TIMINGS and not NOTES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("real launchers: seconds per launch (2 ranks, launcher start to last exit)")
    for note in NOTES:
        write(note)
    programs = list(dict.fromkeys(program for _, program in TIMINGS))
    launchers = list(dict.fromkeys(launcher for launcher, _ in TIMINGS))
    width = max(len(name) for name in launchers) if launchers else 10
    write("")
    write(f"{'launcher':<{width}}  " + "  ".join(f"{program:>22}" for program in programs))
    for launcher in launchers:
        cells = [TIMINGS.get((launcher, program)) for program in programs]
        write(f"{launcher:<{width}}  " + "  ".join(f"{'-' if c is None else f'{c:.1f} s':>22}" for c in cells))
