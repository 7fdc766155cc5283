"""Real launchers on one machine, in a folder of their own: the packages, munge, a two-node Slurm cluster.

The tier needs OpenMPI's ``mpirun``, MPICH's Hydra ``mpiexec`` and Slurm with munge. Where
one of their commands is missing it installs them from the distribution's packages
(``install.sh``: root and ``apt-get``), or says why it cannot.

:class:`SlurmCluster` runs munge, ``slurmctld`` and two ``slurmd`` from one folder: a
key, a socket, state, spool, pid and log files of its own there, private ports, and a
``slurm.conf`` that every command reads through ``SLURM_CONF``. The two nodes are
named for the loopback addresses ``127.0.0.1`` and ``127.0.0.2`` (each ``slurmd -N``
with its own ``Port``), so that the first host of a step's node list, which comm takes
for ``MASTER_ADDR``, resolves. Each daemon runs in the foreground as a child of this
process and is stopped by its pid; it is also told to die with this process
(``PR_SET_PDEATHSIG``). Whatever else a run killed outright leaves (a launcher, a
Slurm step, a rank), ``reaper.py`` stops by its pid: every process the tier starts
carries this run's token in its environment.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from multiproc import free_port, port_is_free, quiet_env, without_launcher

HERE = Path(__file__).resolve().parent
INSTALL = HERE / "install.sh"
# The command each scenario runs, and the package that brings it.
COMMANDS = {
    "mpirun.openmpi": "openmpi-bin",
    "mpiexec.mpich": "mpich",
    "srun": "slurm-client",
    "sbatch": "slurm-client",
    "scancel": "slurm-client",
    "scontrol": "slurm-client",
    "squeue": "slurm-client",
    "sinfo": "slurm-client",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "munged": "munge",
}
PACKAGES = ("openmpi-bin", "mpich", "slurmctld", "slurmd", "slurm-client", "munge")
# The port comm derives from a job id (comm/launch.py): 15000 + job_id % 10000.
JOB_PORT_BASE, JOB_PORT_SPAN = 15000, 10000
NODES = ("127.0.0.1", "127.0.0.2")
# Every process the tier starts carries REAPER_VARIABLE=TOKEN; reaper.py stops them by pid when the run ends or dies.
REAPER = HERE / "reaper.py"
REAPER_VARIABLE = "COMM_LAUNCHERS_TIER"
TOKEN = f"{os.getpid()}-{uuid.uuid4().hex}"
# What the session's summary prints (conftest.py): (launcher, what ran) -> seconds, and notes.
TIMINGS: Dict[Tuple[str, str], float] = {}
NOTES: List[str] = []


def missing_commands() -> List[str]:
    return [name for name in COMMANDS if shutil.which(name) is None]


def why_not_installable() -> Optional[str]:
    """Why the launchers cannot be installed here, or None where ``install.sh`` can run."""
    missing = missing_commands()
    wanted = ", ".join(missing)
    packages = " ".join(PACKAGES)
    if os.geteuid() != 0:
        return (f"the real launchers are not installed ({wanted} missing) and installing them takes root; this runs as "
                f"uid {os.geteuid()}: run `sh {INSTALL.relative_to(HERE.parent.parent)}` as root (apt-get install "
                f"{packages}) and run the tier again")
    if shutil.which("apt-get") is None:
        return (f"the real launchers are not installed ({wanted} missing) and this machine has no apt-get to install "
                f"them: install Debian's {packages}, or the same launchers by other means, and run the tier again")
    return None


def install() -> Tuple[float, str]:
    """Run ``install.sh``; return how long it took and what it printed (the packages' versions last)."""
    start = time.monotonic()
    done = subprocess.run(["sh", str(INSTALL)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{INSTALL} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
    still_missing = missing_commands()
    if still_missing:
        raise RuntimeError(f"{INSTALL} ran, and still {', '.join(still_missing)} missing:\n{done.stdout[-4000:]}")
    return time.monotonic() - start, done.stdout


def versions() -> str:
    """The installed packages' versions, one line each."""
    if shutil.which("dpkg-query") is None:
        return "(no dpkg-query: the launchers' versions are not known)"
    done = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", *PACKAGES], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    return done.stdout.strip()


def launch_env(**extra: str) -> Dict[str, str]:
    """This process's environment without any launcher's variables, quiet, one OpenMP thread a process, and this
    run's token (reaper.py stops every process that carries it)."""
    return {**without_launcher(quiet_env()), REAPER_VARIABLE: TOKEN, **extra}


_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def run(argv: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Optional[Path] = None,
        on_timeout: Optional[Callable[[], None]] = None) -> Tuple[int, str, str, float]:
    """Run ``argv`` in a session of its own; return its exit code, stdout, stderr and seconds."""
    return run_together([argv], env, timeout, cwd, on_timeout)


def run_together(commands: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float,
                 cwd: Optional[Path] = None,
                 on_timeout: Optional[Callable[[], None]] = None) -> Tuple[int, str, str, float]:
    """Start every command at once, each in a session of its own; wait for all of them.

    Returns the first non-zero exit code (else 0), their stdouts and stderrs joined, and
    the seconds until the last one ended. Past ``timeout`` every session (each
    launcher and whatever it forked) is killed by its process-group id, ``on_timeout``
    runs, and the call raises ``TimeoutError`` with what the commands had printed.
    """
    start = time.monotonic()
    processes = [subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for argv in commands]
    outputs: List[Tuple[str, str]] = []
    timed_out = False
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=max(0.1, start + timeout - time.monotonic())))
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in processes:
                kill_session(other)
            if on_timeout is not None:
                on_timeout()
            outputs.append(process.communicate())
        except BaseException:  # interrupted (a SIGTERM to pytest): nothing of this launch outlives it
            for other in processes:
                kill_session(other)
            raise
    stdout = "".join(out for out, _ in outputs)
    stderr = "".join(err for _, err in outputs)
    if timed_out:
        shown = " & ".join(" ".join(argv) for argv in commands)
        raise TimeoutError(f"{shown} ran past {timeout:.0f} s:\n--- stdout ---\n{stdout[-3000:]}\n"
                           f"--- stderr ---\n{stderr[-3000:]}")
    code = next((process.returncode for process in processes if process.returncode), 0)
    return code, stdout, stderr, time.monotonic() - start


def kill_session(process: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGKILL the session ``process`` leads (it was started with ``start_new_session``), by its id."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def job_port(job_id: int) -> int:
    return JOB_PORT_BASE + job_id % JOB_PORT_SPAN


class SlurmCluster:
    """munged, slurmctld and two slurmd, all in ``folder``; ``start()`` then ``stop()``."""

    JOBS = 64  # job ids whose derived ports are checked free before the cluster starts

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.socket = folder / "munge.socket"
        self.daemons: List[Tuple[str, subprocess.Popen]] = []  # type: ignore[type-arg]
        self.first_job_id = 0

    @property
    def env(self) -> Dict[str, str]:
        """What every Slurm command of this cluster runs with: its slurm.conf."""
        return launch_env(SLURM_CONF=str(self.conf))

    def start(self) -> float:
        """Start munge, the controller and both nodes; return the seconds until both nodes were idle."""
        start = time.monotonic()
        for name in ("state", "spool", "tmp"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        files = {name: self.folder / f"munged.{name}" for name in ("pid", "log", "seed")}
        self._daemon("munged", ["munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                                f"--pid-file={files['pid']}", f"--log-file={files['log']}",
                                f"--seed-file={files['seed']}"])
        self._wait_for(lambda: self.socket.exists(), "munged's socket", 20)
        self._write_conf()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: "UP" in self._slurm(["scontrol", "ping"]), "slurmctld to answer", 30)
        for node in NODES:
            self._daemon(f"slurmd {node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_for(self._nodes_idle, "both slurmd to register idle", 60)
        return time.monotonic() - start

    def stop(self) -> None:
        """Cancel every job of this cluster, then stop each daemon by its pid, newest first."""
        if any(name == "slurmctld" and process.poll() is None for name, process in self.daemons):
            try:
                self.cancel_all()
                deadline = time.monotonic() + 20
                while self._slurm(["squeue", "-h", "-o", "%i"]).strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass  # the daemons are stopped all the same; the reaper takes any step left
        for _name, process in reversed(self.daemons):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=15)
        self.daemons.clear()

    def batch(self, script: Path, name: str, timeout: float, cwd: Path) -> Tuple[int, int, float]:
        """``sbatch -N1 -n2 script``, waited for; return the job's id, its exit code and seconds from submission
        to its end. Polled here every 0.2 s: ``sbatch --wait`` polls every few seconds and would time itself."""
        start = time.monotonic()
        output = script.with_suffix(".out")
        argv = ["sbatch", "--parsable", "--job-name", name, "--nodes", "1", "--ntasks", "2", "--output", str(output),
                "--error", str(script.with_suffix(".err")), str(script)]
        done = subprocess.run(argv, env=self.env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed (exit {done.returncode}): {done.stdout}\n{self.logs()}")
        job_id = int(done.stdout.strip().split(";")[0])
        while time.monotonic() < start + timeout:
            fields = self._job(job_id)
            if fields.get("JobState") in _FINISHED_STATES:
                return job_id, int(fields.get("ExitCode", "1:0").split(":")[0]), time.monotonic() - start
            time.sleep(0.2)
        self.cancel_all()
        raise TimeoutError(f"batch job {job_id} ran past {timeout:.0f} s: {self._job(job_id)}\n{self.logs()}")

    def cancel_all(self) -> None:
        jobs = self._slurm(["squeue", "-h", "-o", "%i"]).split()
        if jobs:
            self._slurm(["scancel", *jobs])

    def job_id(self, name: str) -> int:
        """The id of the newest job named ``name`` that this cluster still remembers (MinJobAge: 300 s)."""
        ids = []
        for line in self._slurm(["scontrol", "-o", "show", "job"]).splitlines():
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            if fields.get("JobName") == name:
                ids.append(int(fields["JobId"]))
        if not ids:
            raise LookupError(f"no job named {name!r} in this cluster")
        return max(ids)

    def _job(self, job_id: int) -> Dict[str, str]:
        line = self._slurm(["scontrol", "-o", "show", "job", str(job_id)])
        return dict(item.split("=", 1) for item in line.split() if "=" in item)

    def logs(self) -> str:
        """The tail of each daemon's log, for a failure's message."""
        parts = []
        daemons_output = [self.folder / f"{name.replace(' ', '-')}.out" for name, _ in self.daemons]
        for path in sorted(self.folder.glob("*.log")) + [path for path in daemons_output if path.exists()]:
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(lines))
        for name, process in self.daemons:
            if process.poll() is not None:
                parts.append(f"--- {name} exited {process.returncode} ---")
        return "\n".join(parts)

    def _daemon(self, name: str, argv: List[str]) -> None:
        log = open(self.folder / f"{name.replace(' ', '-')}.out", "wb")
        with log:
            process = subprocess.Popen(argv, env=self.env, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        self.daemons.append((name, process))

    def _slurm(self, argv: List[str]) -> str:
        done = subprocess.run(argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=30)
        return done.stdout

    def _nodes_idle(self) -> bool:
        states = dict(line.split() for line in self._slurm(["sinfo", "-h", "-N", "-o", "%N %t"]).splitlines()
                      if len(line.split()) == 2)
        return all(states.get(node) == "idle" for node in NODES)

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited {process.returncode} while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"waited {timeout:.0f} s for {what}:\n{self.logs()}")

    def _write_conf(self) -> None:
        ports = _free_ports(1 + len(NODES))
        self.first_job_id = _first_job_id(self.JOBS)
        folder = self.folder
        lines = [
            "ClusterName=commlaunchers",
            # slurmctld starts only on the host SlurmctldHost names: this one, reached on loopback.
            f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}/%n",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
            f"TmpFS={folder / 'tmp'}",
            f"PlugStackConfig={folder / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # The nodes are what this file says, whatever the machine reports.
            "SlurmdParameters=config_overrides",
            "MailProg=/bin/true",
            f"FirstJobId={self.first_job_id}",
        ]
        for node, port in zip(NODES, ports[1:]):
            lines.append(f"NodeName={node} NodeAddr={node} Port={port} CPUs=2 State=UNKNOWN")
        lines.append("PartitionName=launchers Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (folder / "plugstack.conf").write_text("")


# A job in one of these states has ended (squeue's JOB STATE CODES).
_FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                              "BOOT_FAIL", "DEADLINE"})


def _free_ports(count: int) -> List[int]:
    ports: List[int] = []
    while len(ports) < count:
        ports.append(free_port(avoid=ports))
    return ports


def _first_job_id(jobs: int) -> int:
    """A first job id whose next ``jobs`` ids all derive free ports (comm's ``15000 + id % 10000``)."""
    for _ in range(200):
        offset = random.randrange(0, JOB_PORT_SPAN - jobs)
        if all(port_is_free(JOB_PORT_BASE + offset + i) for i in range(jobs)):
            return 100_000 + offset
    raise RuntimeError(f"no {jobs} free ports in a row in {JOB_PORT_BASE}-{JOB_PORT_BASE + JOB_PORT_SPAN - 1}")

