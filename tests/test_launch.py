"""comm.launch: which launcher started this process, binding under it, and rendezvous without torchrun."""

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
import torch

import comm
from comm.launch import _expand_hostlist

from multiproc import NPU, free_port, launched_by, port_is_free, run_launched, run_ranks, skip_unless_simulation


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


# (name, environment, the device index bind() must pick on 8 devices)
BINDINGS = [
    ("torchrun", _torchrun(3, 8, 3, 8, 0), 3),
    ("torchrun's LOCAL_RANK alone", {"LOCAL_RANK": "2"}, 2),
    ("srun", _srun(11, 16, 3, 1, "8(x2)"), 3),
    ("OpenMPI", _openmpi(3, 8, 3, 8), 3),
    ("MVAPICH2", _mvapich2(13, 16, 5, 8), 5),
    ("MPICH or Intel MPI", _hydra(6, 8, 6, 8), 6),
    ("jsrun", _jsrun(7, 8, 7, 8), 7),
    ("mpirun inside a SLURM allocation", {**_srun(0, 2, 0, 0, "1(x2)"), **_openmpi(4, 8, 4, 8)}, 4),
    ("srun --pty bash", _srun(3, 4, 3, 0, "4", SLURM_PTY_PORT="34889"), 0),
]


def _bind_under_launchers(rank, world_size, cases):
    seen = {}
    for name, env, _ in cases:
        launched_by(env)
        seen[name] = (str(comm.bind()), torch.npu.current_device())
    launched_by(_srun(11, 16, 3, 1, "8(x2)"))
    seen["explicit"] = (str(comm.bind(5)), torch.npu.current_device())
    errors = {}
    for name, env in [("srun", _srun(10, 32, 10, 0, "16(x2)")), ("openmpi", _openmpi(9, 12, 9, 12))]:
        launched_by(env)
        with pytest.raises(ValueError) as error:
            comm.bind()
        errors[name] = str(error.value)
    return seen, errors


def test_bind_under_each_launcher_on_the_simulated_npu():
    [(seen, errors)] = run_ranks(_bind_under_launchers, 1, backend=None, simulate=NPU, args=(BINDINGS,))
    for name, _, index in BINDINGS:
        assert seen[name] == (f"npu:{index}", index), name
    assert seen["explicit"] == ("npu:5", 5)  # an explicit local rank wins over the launcher's
    assert re.search(r"local_rank 10 is out of range: this process sees 8 npu.*SLURM_LOCALID under launcher 'srun'",
                     errors["srun"])
    assert re.search(r"local_rank 9 .* sees 8 npu.*OMPI_COMM_WORLD_LOCAL_RANK under launcher 'openmpi'",
                     errors["openmpi"])


def _bind_with_one_device(rank, world_size):
    seen = {}
    for name, env in [("srun", _srun(11, 16, 3, 1, "8(x2)")), ("openmpi", _openmpi(13, 16, 5, 8)),
                      ("torchrun", _torchrun(7, 8, 7, 8, 0))]:
        launched_by(env)
        seen[name] = (str(comm.bind()), torch.npu.current_device())
    seen["explicit"] = (str(comm.bind(2)), torch.npu.current_device())
    return seen


def test_a_rank_that_sees_one_device_binds_index_0():
    [seen] = run_ranks(_bind_with_one_device, 1, backend=None, simulate={**NPU, "device_count": 1})
    assert seen == {name: ("npu:0", 0) for name in ("srun", "openmpi", "torchrun", "explicit")}


@pytest.mark.parametrize("visible, expected", [(None, 3), ("5", 0), ("GPU-5a1b", 0), ("0,1,2,3,4,5,6,7", 3),
                                               ("4,5", "sees 2 cuda device")])
def test_cuda_visible_devices_counts_as_torch_counts_it(launched, monkeypatch, request, visible, expected):
    # A CUDA build's C probes cannot run here; everything above them (torch.cuda's own
    # reading of CUDA_VISIBLE_DEVICES) is torch's code.
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 8, raising=False)  # the runtime's count
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 8)  # NVML's count of the machine's GPUs
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: [f"GPU-{i}a1b2c3" for i in range(8)])
    bound = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", bound.append, raising=False)
    forget_count = getattr(torch.cuda.device_count, "cache_clear", lambda: None)  # torch < 2.4 caches it
    forget_count()
    request.addfinalizer(forget_count)
    monkeypatch.setenv("COMM_DEVICE", "cuda")
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    launched(_srun(11, 16, 3, 1, "8(x2)"))
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=f"local_rank 3 is out of range: this process {expected}.*'srun'"):
            comm.bind()
        assert bound == []
    else:
        assert (comm.bind(), bound) == (torch.device("cuda", expected), [expected])


LAUNCHED_RANK = str(Path(__file__).with_name("launched_rank.py"))


def _free_job_port():
    """A SLURM job id whose derived port (15000 + id % 10000) is free here."""
    for _ in range(100):
        port = random.randrange(15000, 25000)
        if port_is_free(port):
            return 5_000_000 + port - 15000, port
    pytest.skip("no free port in 15000-24999")


def _report(stdout):
    """The rank's JSON line: torch 2.9's gloo prints its connections around it."""
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


@pytest.mark.integration
def test_two_ranks_started_by_srun_alone():
    skip_unless_simulation()
    job_id, port = _free_job_port()
    envs = [_srun(rank, 2, rank, 0, "2", nodelist="127.0.0.[1]", job_id=str(job_id)) for rank in range(2)]
    results = [_report(out) for out in run_launched(LAUNCHED_RANK, envs)]
    for rank, seen in enumerate(results):
        assert seen == {"launcher": "srun", "rank": rank, "world_size": 2, "master_addr": "127.0.0.1",
                        "master_port": port, "device": f"npu:{rank}", "current_index": rank, "backend": "hccl",
                        "sum": 3.0, "torchrun_variables": []}


@pytest.mark.integration
def test_two_ranks_started_by_openmpi_with_master_address():
    skip_unless_simulation()
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [{**_openmpi(rank, 2, rank, 2), **master} for rank in range(2)]
    results = [_report(out) for out in run_launched(LAUNCHED_RANK, envs)]
    for rank, seen in enumerate(results):
        assert seen == {"launcher": "openmpi", "rank": rank, "world_size": 2, "master_addr": "127.0.0.1",
                        "master_port": int(master["MASTER_PORT"]), "device": f"npu:{rank}", "current_index": rank,
                        "backend": "hccl", "sum": 3.0, "torchrun_variables": ["MASTER_ADDR"]}
