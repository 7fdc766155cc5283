"""comm.launch: which launcher started this process, read from its variables."""

import dataclasses

import pytest

import comm
from comm.launch import _expand_hostlist

from multiproc import launched_by


def _srun(procid, ntasks, localid, nodeid, per_node, nodelist="node[01-02]", job_id="4242", **extra):
    """What srun sets for one task of a step (the variables comm reads, and their neighbours)."""
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_TASKS_PER_NODE": per_node, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist, "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train",
            **extra}


def _openmpi(rank, size, local_rank, local_size, **extra):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            "OMPI_COMM_WORLD_NODE_RANK": str(local_rank), **extra}


def _mvapich2(rank, size, local_rank, local_size):
    return {"MV2_COMM_WORLD_RANK": str(rank), "MV2_COMM_WORLD_SIZE": str(size),
            "MV2_COMM_WORLD_LOCAL_RANK": str(local_rank), "MV2_COMM_WORLD_LOCAL_SIZE": str(local_size)}


def _hydra(rank, size, local_rank, local_size):
    """MPICH's and Intel MPI's mpiexec (Hydra)."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(local_rank),
            "MPI_LOCALNRANKS": str(local_size)}


def _jsrun(rank, size, local_rank, local_size, job_id="777"):
    return {"JSM_NAMESPACE_RANK": str(rank), "JSM_NAMESPACE_SIZE": str(size),
            "JSM_NAMESPACE_LOCAL_RANK": str(local_rank), "JSM_NAMESPACE_LOCAL_SIZE": str(local_size),
            "LSB_JOBID": job_id}


def _torchrun(rank, size, local_rank, local_size, group_rank, port="29400"):
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(group_rank), "MASTER_ADDR": "head",
            "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "none"}


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables for one test, with every other launcher's removed."""
    return lambda env: launched_by(env, monkeypatch)


_SINGLE = dict(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
               master_addr=None, master_port=None)

# (name, environment, the record's fields, some of its sources)
LAUNCHES = [
    ("srun, 2 nodes of 4", _srun(5, 8, 1, 1, "4(x2)"),
     dict(launcher="srun", rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
          master_addr="node01", master_port=19242),
     {"rank": "SLURM_PROCID", "world_size": "SLURM_STEP_NUM_TASKS", "local_rank": "SLURM_LOCALID",
      "node_rank": "SLURM_NODEID", "master_addr": "SLURM_STEP_NODELIST", "master_port": "SLURM_JOB_ID"}),
    ("srun, uneven nodes", _srun(3, 4, 0, 1, "3,1", nodelist="gpu[1-2]-ib,cpu3", job_id="123456"),
     dict(launcher="srun", rank=3, world_size=4, local_rank=0, local_world_size=1, node_rank=1,
          master_addr="gpu1-ib", master_port=18456), {"local_world_size": "SLURM_STEP_TASKS_PER_NODE"}),
    ("srun with MASTER_ADDR and MASTER_PORT", _srun(0, 2, 0, 0, "2", MASTER_ADDR="10.0.0.5", MASTER_PORT="29500"),
     dict(launcher="srun", rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0,
          master_addr="10.0.0.5", master_port=29500), {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}),
    ("srun with PMI_RANK (--mpi=pmi2), no Hydra", {**_srun(1, 2, 1, 0, "2"), "PMI_RANK": "1", "PMI_SIZE": "2"},
     dict(launcher="srun", rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0,
          master_addr="node01", master_port=19242), {}),
    ("torchrun inside a SLURM allocation", {**_srun(0, 2, 0, 0, "1(x2)"), **_torchrun(9, 16, 1, 8, 1)},
     dict(launcher="torchrun", rank=9, world_size=16, local_rank=1, local_world_size=8, node_rank=1,
          master_addr="head", master_port=29400),
     {"launcher": "RANK", "local_world_size": "LOCAL_WORLD_SIZE", "node_rank": "GROUP_RANK"}),
    ("torchrun's LOCAL_RANK alone", {"LOCAL_RANK": "3"},
     dict(launcher="torchrun", rank=0, world_size=1, local_rank=3, local_world_size=1, node_rank=0,
          master_addr=None, master_port=None),
     {"launcher": "LOCAL_RANK", "rank": "(default)", "world_size": "(default)", "node_rank": "(derived)"}),
    ("mpirun inside a SLURM allocation", {**_srun(0, 2, 0, 0, "1(x2)"), **_openmpi(6, 8, 2, 4)},
     dict(launcher="openmpi", rank=6, world_size=8, local_rank=2, local_world_size=4, node_rank=1,
          master_addr=None, master_port=19242),
     {"launcher": "OMPI_COMM_WORLD_LOCAL_RANK", "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
      "node_rank": "(derived)", "master_port": "SLURM_JOB_ID"}),
    ("OpenMPI", _openmpi(3, 4, 1, 2),
     dict(launcher="openmpi", rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
          master_addr=None, master_port=None), {"master_addr": "(default)", "master_port": "(default)"}),
    ("MVAPICH2", {**_mvapich2(2, 4, 0, 2), "MASTER_ADDR": "n1"},
     dict(launcher="mvapich2", rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1,
          master_addr="n1", master_port=None), {"world_size": "MV2_COMM_WORLD_SIZE"}),
    ("MPICH or Intel MPI", _hydra(5, 6, 2, 3),
     dict(launcher="mpich", rank=5, world_size=6, local_rank=2, local_world_size=3, node_rank=1,
          master_addr=None, master_port=None), {"rank": "PMI_RANK", "local_world_size": "MPI_LOCALNRANKS"}),
    ("jsrun", _jsrun(7, 12, 1, 6),
     dict(launcher="jsrun", rank=7, world_size=12, local_rank=1, local_world_size=6, node_rank=1,
          master_addr=None, master_port=15777), {"master_port": "LSB_JOBID"}),
    ("srun --pty bash (interactive)", _srun(0, 4, 0, 0, "4", SLURM_PTY_PORT="34889"), _SINGLE, {}),
    ("srun of one task", _srun(0, 1, 0, 0, "1", SLURM_JOB_NAME="interactive"), _SINGLE, {}),
    ("no launcher", {}, _SINGLE, {"rank": "(default)", "launcher": "(default)"}),
]


@pytest.mark.parametrize("env, fields, sources", [case[1:] for case in LAUNCHES], ids=[case[0] for case in LAUNCHES])
def test_launch_info_under_each_launcher(launched, env, fields, sources):
    launched(env)
    info = comm.launch_info()
    assert {name: getattr(info, name) for name in fields} == fields
    assert {name: info.sources[name] for name in sources} == sources
    assert set(info.sources) == {f.name for f in dataclasses.fields(info)} - {"sources"}


def test_the_record_is_immutable(launched):
    launched(_srun(5, 8, 1, 1, "4(x2)"))
    info = comm.launch_info()
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 0
    with pytest.raises(TypeError):
        info.sources["rank"] = "RANK"
    assert comm.launch_info() == info


HOST_LISTS = [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[1-2]-ib,cpu3", ["gpu1-ib", "gpu2-ib", "cpu3"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("a, b[3]", ["a", "b3"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ("login", ["login"]),
]


@pytest.mark.parametrize("nodelist, hosts", HOST_LISTS, ids=[case[0] for case in HOST_LISTS])
def test_host_lists(launched, nodelist, hosts):
    assert _expand_hostlist(nodelist, "SLURM_JOB_NODELIST") == hosts
    env = _srun(0, 2, 0, 0, "2", nodelist=nodelist)
    del env["SLURM_STEP_NODELIST"]
    launched(env)
    assert (comm.launch_info().master_addr, comm.launch_info().sources["master_addr"]) == (hosts[0],
                                                                                           "SLURM_JOB_NODELIST")


@pytest.mark.parametrize("job_id, port", [("0", 15000), ("4242", 19242), ("123456", 18456), ("99999999", 24999),
                                          ("10000", 15000)])
def test_port_derived_from_the_job_id(launched, job_id, port):
    launched(_srun(1, 2, 1, 0, "2", job_id=job_id))
    assert comm.launch_info().master_port == port


@pytest.mark.parametrize("node, local_world_size", [(0, 4), (1, 4), (2, 3)])
def test_tasks_per_node_follow_the_node(launched, node, local_world_size):
    launched(_srun(8 + node, 11, 0, node, "4(x2),3"))
    assert comm.launch_info().local_world_size == local_world_size


# (the variable the error must name, the environment)
MALFORMED = [
    ("SLURM_PROCID", _srun("x", 8, 1, 1, "4(x2)")),
    ("SLURM_PROCID", _srun(-1, 8, 1, 1, "4(x2)")),
    ("SLURM_PROCID", _srun(8, 8, 1, 1, "4(x2)")),
    ("SLURM_STEP_NUM_TASKS", _srun(0, "two", 0, 0, "2")),
    ("SLURM_LOCALID", _srun(5, 8, 4, 1, "4(x2)")),
    ("SLURM_LOCALID", _srun(5, 8, "", 1, "4(x2)")),
    ("SLURM_STEP_TASKS_PER_NODE", _srun(5, 8, 1, 1, "4(x)")),
    ("SLURM_STEP_TASKS_PER_NODE", _srun(1, 8, 1, 0, "16")),
    ("SLURM_NODEID", _srun(5, 8, 1, 2, "4(x2)")),
    ("SLURM_STEP_NODELIST", _srun(0, 2, 0, 0, "2", nodelist="node[01-")),
    ("SLURM_STEP_NODELIST", _srun(0, 2, 0, 0, "2", nodelist="node[04-01]")),
    ("SLURM_STEP_NODELIST", _srun(0, 2, 0, 0, "2", nodelist="node[a-b]")),
    ("SLURM_STEP_NODELIST", _srun(0, 2, 0, 0, "2", nodelist="node]1[")),
    ("SLURM_STEP_NODELIST", _srun(0, 2, 0, 0, "2", nodelist="a,,b")),
    ("SLURM_STEP_NODELIST", _srun(0, 2, 0, 0, "2", nodelist="")),
    ("SLURM_JOB_ID", _srun(0, 2, 0, 0, "2", job_id="abc")),
    ("MASTER_PORT", _srun(0, 2, 0, 0, "2", MASTER_PORT="70000")),
    ("MASTER_PORT", _srun(0, 2, 0, 0, "2", MASTER_PORT="http")),
    ("MASTER_PORT", {**_openmpi(0, 2, 0, 2), "MASTER_PORT": "0"}),
    ("MASTER_ADDR", {**_openmpi(0, 2, 0, 2), "MASTER_ADDR": " "}),
    ("OMPI_COMM_WORLD_SIZE", {k: v for k, v in _openmpi(0, 2, 0, 2).items() if k != "OMPI_COMM_WORLD_SIZE"}),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", _openmpi(0, 8, 0, 9)),
    ("PMI_RANK", _hydra(4, 4, 0, 4)),
    ("MV2_COMM_WORLD_LOCAL_RANK", _mvapich2(0, 4, "x", 2)),
    ("JSM_NAMESPACE_SIZE", _jsrun(0, 0, 0, 1)),
    ("LSB_JOBID", _jsrun(0, 2, 0, 2, job_id="-5")),
    ("RANK", {"RANK": "4", "WORLD_SIZE": "4"}),
    ("LOCAL_RANK", {"LOCAL_RANK": "-2"}),
    ("WORLD_SIZE", {"WORLD_SIZE": "0"}),
    ("LOCAL_RANK", {"LOCAL_RANK": "abc"}),
]


@pytest.mark.parametrize("variable, env", MALFORMED, ids=[f"{i}-{case[0]}" for i, case in enumerate(MALFORMED)])
def test_a_malformed_variable_is_a_value_error_naming_it(launched, variable, env):
    launched(env)
    with pytest.raises(ValueError, match=rf"^{variable}[= ].*expected"):
        comm.launch_info()
