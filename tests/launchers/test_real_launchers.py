"""Real launchers start two ranks of a script that names none of them (issue 36).

Under each launcher, two ranks of ``rank.py`` (no launcher-specific line) bind,
initialise and all-reduce, on the CPU (gloo) and on two simulated NPUs (hccl), and
``examples/bind_and_reduce.py --simulate npu`` runs unchanged. Every rank's report is
checked: the launcher ``comm.launch_info()`` detected and the variable that told it,
rank and world size, the bound device (``npu:<local rank>``, ``cpu`` without the
simulation), the backend, both sums, and where the rendezvous address and port came
from. The launchers:

* OpenMPI's ``mpirun`` and MPICH's ``mpiexec`` (Hydra), outside any job: ``MASTER_ADDR``
  and ``MASTER_PORT`` passed with ``-x`` / ``-genv`` (without ``MASTER_PORT`` a rank
  fails, saying so: no job id to derive it from);
* Slurm's ``srun -N1 -n2``, ``srun -N2 -n2`` across two ``slurmd`` (two nodes on this
  machine, so every rank has local rank 0), ``srun --mpi=pmi2`` (which sets
  ``PMI_RANK`` but not Hydra's ``MPI_LOCALRANKID``), with no ``MASTER_*`` at all: the
  address is the step's first node, the port the job id's;
* ``sbatch -N1 -n2`` with ``mpirun`` and with ``mpiexec`` inside: MPI's variables win
  over the ``SLURM_*`` the ranks inherit, ``MASTER_ADDR`` is passed, the port is the
  job id's;
* two torchrun agents (``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on
  127.0.0.1), so that ``RANK`` differs from ``LOCAL_RANK``.

Run by ``make test-launchers`` (root, or the packages already installed: see
``install.sh``); it prints each launch's time at the end.
"""

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from launcher_harness import TIMINGS, SlurmCluster, job_port, launch_env, run, run_together

from multiproc import free_port, skip_unless_simulation

pytestmark = pytest.mark.launchers

ROOT = Path(__file__).resolve().parents[2]
RANK = Path(__file__).with_name("rank.py")
EXAMPLE = ROOT / "examples" / "bind_and_reduce.py"
PYTHON = sys.executable
LOOPBACK = "127.0.0.1"
TIMEOUT = 180.0  # one launch of two ranks: about 3 to 10 s on an idle 2-core machine

# What runs under each launcher: (argv after the interpreter, what the summary calls it).
PROGRAMS = {
    "cpu": ([str(RANK)], "rank.py: CPU, gloo"),
    "npu": ([str(RANK), "--simulate", "npu"], "rank.py: 2 NPUs, hccl"),
    "example": ([str(EXAMPLE), "--simulate", "npu"], "bind_and_reduce.py --simulate npu"),
}


@dataclass(frozen=True)
class Launch:
    key: str
    title: str
    launcher: str  # what comm.launch_info() must say
    detected_by: str  # the variable by which comm must have recognised it
    local_rank_from: str
    nodes: int  # the "nodes" the two ranks run on: one each on two, so local rank 0 for both
    addr_from: str  # the variable behind master_addr
    port_from: str  # the variable behind master_port


_OMPI = ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_HYDRA = ("mpich", "MPI_LOCALRANKID", "MPI_LOCALRANKID")
_SRUN = ("srun", "SLURM_PROCID", "SLURM_LOCALID")
LAUNCHES = [
    Launch("mpirun-openmpi", "mpirun (OpenMPI)", *_OMPI, 1, "MASTER_ADDR", "MASTER_PORT"),
    Launch("mpiexec-mpich", "mpiexec (MPICH Hydra)", *_HYDRA, 1, "MASTER_ADDR", "MASTER_PORT"),
    Launch("srun", "srun -N1 -n2", *_SRUN, 1, "SLURM_STEP_NODELIST", "SLURM_JOB_ID"),
    Launch("srun-two-nodes", "srun -N2 -n2 (2 slurmd)", *_SRUN, 2, "SLURM_STEP_NODELIST", "SLURM_JOB_ID"),
    Launch("srun-pmi2", "srun --mpi=pmi2 -N1 -n2", *_SRUN, 1, "SLURM_STEP_NODELIST", "SLURM_JOB_ID"),
    Launch("sbatch-mpirun", "sbatch -N1 -n2: mpirun", *_OMPI, 1, "MASTER_ADDR", "SLURM_JOB_ID"),
    Launch("sbatch-mpiexec", "sbatch -N1 -n2: mpiexec", *_HYDRA, 1, "MASTER_ADDR", "SLURM_JOB_ID"),
    Launch("torchrun-two-agents", "torchrun: 2 agents, c10d", "torchrun", "RANK", "LOCAL_RANK", 2, "MASTER_ADDR",
           "MASTER_PORT"),
]


def mpi_command(mpi: str, master_addr: Optional[str], master_port: Optional[int]) -> List[str]:
    """Two ranks under OpenMPI's mpirun or MPICH's mpiexec, each called by its own name, with these MASTER_*."""
    variables = [(name, str(value)) for name, value in (("MASTER_ADDR", master_addr), ("MASTER_PORT", master_port))
                 if value is not None]
    if mpi == "openmpi":
        # Root needs --allow-run-as-root; --oversubscribe lets 2 ranks run on a 1-core machine.
        argv = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
        return argv + [arg for name, value in variables for arg in ("-x", f"{name}={value}")]
    return ["mpiexec.mpich", "-n", "2"] + [arg for name, value in variables for arg in ("-genv", name, value)]


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float
    master_port: Optional[int]  # the port every rank must report; None where the launcher picks it

    def detail(self) -> str:
        return f"exit {self.code}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"


def launch(how: Launch, program: List[str], name: str, request: pytest.FixtureRequest) -> Ran:
    """Start two ranks of ``python program`` the way ``how`` says; wait for both."""
    command = [PYTHON, *program]
    if how.key in ("mpirun-openmpi", "mpiexec-mpich"):
        port = free_port()
        code, out, err, seconds = run(mpi_command(how.launcher, LOOPBACK, port) + command, launch_env(), TIMEOUT)
        return Ran(code, out, err, seconds, port)
    if how.key == "torchrun-two-agents":
        agent = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{free_port()}", "--rdzv-id", name, *program]
        return Ran(*run_together([agent, agent], launch_env(), TIMEOUT), None)
    cluster: SlurmCluster = request.getfixturevalue("slurm_cluster")
    if how.key.startswith("srun"):
        argv = ["srun", "--job-name", name, "--nodes", str(how.nodes), "--ntasks", "2", "--kill-on-bad-exit=1"]
        if how.key == "srun-pmi2":
            argv.append("--mpi=pmi2")
        code, out, err, seconds = run(argv + command, cluster.env, TIMEOUT, cwd=ROOT, on_timeout=cluster.cancel_all)
        return Ran(code, out, err, seconds, job_port(cluster.job_id(name)))
    # sbatch: the job script starts the MPI, which finds its allocation in SLURM_*; no MASTER_PORT.
    script = cluster.folder / f"{name}.sh"
    script.write_text("#!/bin/sh\nexec " + shlex.join(mpi_command(how.launcher, LOOPBACK, None) + command) + "\n")
    job_id, code, seconds = cluster.batch(script, name, TIMEOUT, cwd=ROOT)
    stdout, stderr = (path.read_text() if path.exists() else "" for path in map(script.with_suffix, (".out", ".err")))
    return Ran(code, stdout, stderr, seconds, job_port(job_id))


CASES = [pytest.param(how, program, id=f"{how.key}-{program}") for how in LAUNCHES for program in PROGRAMS]


@pytest.mark.parametrize(("how", "program"), CASES)
def test_two_ranks_under_a_real_launcher(launchers_installed: None, request: pytest.FixtureRequest, how: Launch,
                                         program: str) -> None:
    simulated = program != "cpu"
    if simulated:
        skip_unless_simulation()
    argv, title = PROGRAMS[program]
    ran = launch(how, argv, f"comm-{how.key}-{program}", request)
    TIMINGS[(how.title, title)] = ran.seconds
    assert ran.code == 0, f"{how.title} running {title} failed: {ran.detail()}"
    expected_devices = {rank: f"npu:{rank if how.nodes == 1 else 0}" if simulated else "cpu" for rank in range(2)}
    if program == "example":
        _check_example(ran, expected_devices)
    else:
        _check_reports(how, ran, expected_devices, "hccl" if simulated else "gloo")


def _check_reports(how: Launch, ran: Ran, devices: Dict[int, str], backend: str) -> None:
    reports = sorted((json.loads(line.split(" ", 1)[1]) for line in ran.stdout.splitlines()
                      if line.startswith("COMM_RANK ")), key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == [0, 1], f"expected one report from each of 2 ranks: {ran.detail()}"
    addresses = {report["master_addr"] for report in reports}
    ports = {report["master_port"] for report in reports}
    assert len(addresses) == 1 and len(ports) == 1, f"the ranks disagree on where rank 0 listens: {reports}"
    address = LOOPBACK if how.launcher != "torchrun" else addresses.pop()  # torchrun's agent picks it
    port = ran.master_port if ran.master_port is not None else ports.pop()
    for report in reports:
        rank = report["rank"]
        local_rank = rank if how.nodes == 1 else 0
        seen = {key: report[key] for key in ("launcher", "world_size", "launch", "master_addr", "master_port",
                                             "sources", "device", "current_device", "backend", "sum_on_device",
                                             "sum_on_cpu")}
        assert seen == {
            "launcher": how.launcher,
            "world_size": 2,
            "launch": {"rank": rank, "world_size": 2, "local_rank": local_rank, "local_world_size": 2 // how.nodes,
                       "node_rank": rank // (2 // how.nodes)},
            "master_addr": address,
            "master_port": port,
            "sources": {"launcher": how.detected_by, "local_rank": how.local_rank_from, "master_addr": how.addr_from,
                        "master_port": how.port_from},
            "device": devices[rank],
            "current_device": devices[rank],
            "backend": backend,
            "sum_on_device": [3.0] * 4,
            "sum_on_cpu": [3.0] * 4,
        }, f"rank {rank} under {how.title}"


_EXAMPLE_LINE = re.compile(r"rank (\d+)/(\d+): device=(\S+) backend=(\S+) all_reduce sum=(\S+) ok")


def _check_example(ran: Ran, devices: Dict[int, str]) -> None:
    matches = [_EXAMPLE_LINE.fullmatch(line) for line in ran.stdout.splitlines()]
    lines: List[Tuple[str, ...]] = sorted(match.groups() for match in matches if match)
    assert lines == [(str(rank), "2", devices[rank], "hccl", "3") for rank in range(2)], ran.detail()


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_an_mpi_outside_a_job_needs_master_port(launchers_installed: None, mpi: str) -> None:
    """No job id to derive the port from: each rank fails, naming MASTER_PORT (docs/launchers.md)."""
    argv = mpi_command(mpi, LOOPBACK, None) + [PYTHON, str(RANK)]
    code, out, err, seconds = run(argv, launch_env(), TIMEOUT)
    TIMINGS[({"openmpi": "mpirun (OpenMPI)", "mpich": "mpiexec (MPICH Hydra)"}[mpi], "no MASTER_PORT: fails")] = seconds
    expected = f"MASTER_PORT is not set, so comm cannot tell where rank 0 of this {mpi} launch listens"
    assert code != 0 and expected in out + err, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
