"""How this process was launched: its rank, its place on its node, and where rank 0 listens.

Every launcher tells its processes who they are, each through its own environment
variables: torchrun through ``RANK`` and ``LOCAL_RANK``, SLURM's srun through
``SLURM_PROCID`` and ``SLURM_LOCALID``, the MPIs and LSF's jsrun through theirs.
:func:`launch_info` reads whichever launcher started this process, so binding and
rendezvous work under each of them, not only under torchrun.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

__all__ = ["LaunchInfo", "launch_info"]

# Where a value came from when no variable gave it.
_DEFAULT = "(default)"
_DERIVED = "(derived)"

# The port every rank derives from the job id when MASTER_PORT is not set:
# _PORT_BASE + job_id % _PORT_SPAN, i.e. 15000-24999. Unprivileged, and below
# Linux's ephemeral range (32768-60999), so no outgoing connection holds it by chance.
_PORT_BASE = 15000
_PORT_SPAN = 10000


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is in its launch, and the environment variable behind each value.

    ``sources`` maps each field name to the variable it was read from, or to
    ``"(default)"`` / ``"(derived)"`` where no variable gave it (a single process's
    rank 0, a node rank computed as ``rank // local_world_size``).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    sources: Mapping[str, str] = field(hash=False)


class _Variables(NamedTuple):
    """The variables a launcher sets for its rank, world size, local rank and local size."""

    launcher: str
    rank: str
    world_size: str
    local_rank: str
    local_world_size: str


_TORCHRUN = _Variables("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# Checked in this order after torchrun and before SLURM: an mpirun inside a SLURM
# allocation inherits SLURM's variables (SLURM_LOCALID=0 among them), so MPI's must
# be read first. Each is recognised by its local-rank variable, which MPICH's and
# Intel MPI's Hydra set and SLURM's PMI plugins (which also set PMI_RANK) do not.
_MPI_LIKE = (
    _Variables("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"),
    _Variables("mvapich2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
               "MV2_COMM_WORLD_LOCAL_SIZE"),
    _Variables("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    _Variables("jsrun", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK",
               "JSM_NAMESPACE_LOCAL_SIZE"),
)

# srun sets these for every task of a step; the SLURM_STEP_* ones describe the step
# itself, where SLURM_NTASKS and SLURM_TASKS_PER_NODE may describe the whole job.
_SRUN = _Variables("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE")
_SRUN_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_JOB_IDS = ("SLURM_JOB_ID", "LSB_JOBID")  # SLURM's, then LSF's (jsrun)


def launch_info() -> LaunchInfo:
    """Say how this process was launched, from the launcher's environment variables.

    Checked in this order: torchrun (``RANK``, ``WORLD_SIZE`` or ``LOCAL_RANK`` set),
    OpenMPI, MVAPICH2, MPICH and Intel MPI (Hydra), LSF jsrun, SLURM srun, else a
    single process. An srun step of one task, or an interactive ``srun --pty``
    shell, is a single process. Variables that are present but malformed are a
    ``ValueError`` naming the variable.
    """
    env = os.environ
    fields = _launcher_fields(env)
    launcher = fields.launcher
    addr = _master_addr(env, launcher)
    port = _master_port(env, launcher)
    sources = {**fields.sources, "master_addr": addr[1], "master_port": port[1]}
    return LaunchInfo(launcher, *fields.values, master_addr=addr[0], master_port=port[0],
                      sources=MappingProxyType(sources))


class _Fields(NamedTuple):
    launcher: str
    values: Tuple[int, int, int, int, int]  # rank, world size, local rank, local size, node rank
    sources: Dict[str, str]


_RANK_FIELDS = ("rank", "world_size", "local_rank", "local_world_size", "node_rank")


def _launcher_fields(env: Mapping[str, str]) -> _Fields:
    if any(name in env for name in (_TORCHRUN.rank, _TORCHRUN.world_size, _TORCHRUN.local_rank)):
        return _read_torchrun(env)
    for variables in _MPI_LIKE:
        if variables.local_rank in env:
            return _read_required(env, variables, variables.local_rank, node_rank=None)
    if _is_srun_launch(env):
        return _read_required(env, _SRUN, _SRUN.rank, node_rank="SLURM_NODEID")
    return _Fields("single", (0, 1, 0, 1, 0), dict.fromkeys(("launcher",) + _RANK_FIELDS, _DEFAULT))


def _is_srun_launch(env: Mapping[str, str]) -> bool:
    """Whether srun started this process as one of several tasks.

    ``srun --pty bash`` sets ``SLURM_PTY_PORT``: a program run from that shell is not
    a task of a launch. Neither is the only task of a step. The job name
    (``bash``/``interactive``, which Lightning checks) is not used: a job started by
    ``salloc`` keeps it for every later ``srun -n 8 python train.py``.
    """
    if _SRUN.rank not in env or _SRUN.world_size not in env or "SLURM_PTY_PORT" in env:
        return False
    return _integer(env, _SRUN.world_size, minimum=1) > 1


def _read_torchrun(env: Mapping[str, str]) -> _Fields:
    """torch's env:// variables; one left unset takes the single-process value."""
    sources = {"launcher": next(name for name in _TORCHRUN[1:] if name in env)}
    rank = _optional(env, _TORCHRUN.rank, 0, 0, sources, "rank")
    world_size = _optional(env, _TORCHRUN.world_size, 1, 1, sources, "world_size")
    local_rank = _optional(env, _TORCHRUN.local_rank, 0, 0, sources, "local_rank")
    local_size = _optional(env, _TORCHRUN.local_world_size, world_size, 1, sources, "local_world_size")
    values = _checked(sources, rank, world_size, local_rank, local_size)
    return _Fields(_TORCHRUN.launcher, values + (_node_rank(env, "GROUP_RANK", values, sources),), sources)


def _optional(env: Mapping[str, str], name: str, default: int, minimum: int, sources: Dict[str, str],
              what: str) -> int:
    if name not in env:
        sources[what] = _DEFAULT
        return default
    sources[what] = name
    return _integer(env, name, minimum)


def _read_required(env: Mapping[str, str], variables: _Variables, detected_by: str,
                   node_rank: Optional[str]) -> _Fields:
    """A launcher that sets all four of its variables for every process it starts."""
    for name in variables[1:]:
        if name not in env:
            raise ValueError(f"{name} is not set, but {detected_by} is: {variables.launcher} sets both for "
                             f"every process it starts; expected {name} to be set too")
    sources = dict(zip(("launcher",) + _RANK_FIELDS[:4], (detected_by,) + variables[1:]))
    rank = _integer(env, variables.rank, 0)
    world_size = _integer(env, variables.world_size, 1)
    local_rank = _integer(env, variables.local_rank, 0)
    local_size = _tasks_on_this_node(env) if variables is _SRUN else _integer(env, variables.local_world_size, 1)
    values = _checked(sources, rank, world_size, local_rank, local_size)
    return _Fields(variables.launcher, values + (_node_rank(env, node_rank, values, sources),), sources)


def _checked(sources: Dict[str, str], rank: int, world_size: int, local_rank: int,
             local_size: int) -> Tuple[int, int, int, int]:
    """Check each value against its bound where both came from the launcher's variables."""
    _within(sources, "rank", rank, "world_size", world_size)
    _within(sources, "local_rank", local_rank, "local_world_size", local_size)
    _within(sources, "local_world_size", local_size, "world_size", world_size, inclusive=True)
    return rank, world_size, local_rank, local_size


def _within(sources: Dict[str, str], what: str, value: int, bound_what: str, bound: int,
            inclusive: bool = False) -> None:
    name, bound_name = sources[what], sources[bound_what]
    fits = value <= bound if inclusive else value < bound
    if not fits and _DEFAULT not in (name, bound_name):
        relation = "<=" if inclusive else "<"
        raise ValueError(f"{name}={value} is out of range; expected {name} {relation} {bound_name}={bound}")


def _node_rank(env: Mapping[str, str], name: Optional[str], values: Tuple[int, int, int, int],
               sources: Dict[str, str]) -> int:
    """The launcher's node index, else ``rank // local_world_size`` (right for by-slot placement)."""
    if name is not None and name in env:
        sources["node_rank"] = name
        return _integer(env, name, 0)
    sources["node_rank"] = _DERIVED
    return values[0] // values[3]


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """This node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (``"4(x2),3"``: 4, 4, 3)."""
    name = _SRUN.local_world_size
    counts = _tasks_per_node(env[name], name)
    node = _integer(env, "SLURM_NODEID", 0) if "SLURM_NODEID" in env else 0
    if node >= len(counts):
        raise ValueError(f"SLURM_NODEID={node} has no entry in {name}={env[name]!r}; expected "
                         f"0 <= SLURM_NODEID < {len(counts)}")
    return counts[node]


def _tasks_per_node(text: str, name: str) -> List[int]:
    """Expand SLURM's task counts per node, ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: List[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", item)
        if match is None or int(match.group(1)) < 1:
            raise ValueError(f"{name}={text!r} is not a list of task counts; expected a form such as '4(x2),3'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _integer(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env[name]
    kind = {0: "a non-negative integer", 1: "a positive integer"}[minimum]
    if re.fullmatch(r"\s*[+-]?[0-9]+\s*", raw) is None:
        raise ValueError(f"{name}={raw!r} is not an integer; expected {kind}")
    value = int(raw)
    if value < minimum:
        raise ValueError(f"{name}={raw!r} is out of range; expected {kind}")
    return value


def _master_addr(env: Mapping[str, str], launcher: str) -> Tuple[Optional[str], str]:
    """``MASTER_ADDR``, else under srun the first host of the step's node list."""
    if "MASTER_ADDR" in env:
        if not env["MASTER_ADDR"].strip():
            raise ValueError(f"MASTER_ADDR={env['MASTER_ADDR']!r} is empty; expected the host name or address "
                             "of rank 0's node")
        return env["MASTER_ADDR"].strip(), "MASTER_ADDR"
    if launcher == "srun":
        for name in _SRUN_NODE_LISTS:
            if name in env:
                return _expand_hostlist(env[name], name)[0], name
    return None, _DEFAULT


def _master_port(env: Mapping[str, str], launcher: str) -> Tuple[Optional[int], str]:
    """``MASTER_PORT``, else derived from the job id, the same on every rank."""
    if "MASTER_PORT" in env:
        port = _integer(env, "MASTER_PORT", 1)
        if port > 65535:
            raise ValueError(f"MASTER_PORT={env['MASTER_PORT']!r} is out of range; expected 1 <= MASTER_PORT <= 65535")
        return port, "MASTER_PORT"
    if launcher in ("torchrun", "single"):
        return None, _DEFAULT
    for name in _JOB_IDS:
        if name in env:
            return _port_for_job(_integer(env, name, 0)), name
    return None, _DEFAULT


def _port_for_job(job_id: int) -> int:
    """The rendezvous port of a job: ``15000 + job_id % 10000``."""
    return _PORT_BASE + job_id % _PORT_SPAN


def _expand_hostlist(text: str, name: str) -> List[str]:
    """Expand a SLURM host list: ``"node[01-02,07],gpu[1-2]-ib"`` -> node01, node02, node07, gpu1-ib, gpu2-ib.

    Zero padding is kept (the width of each range's first number), and several
    bracket groups in one name expand to every combination, as ``scontrol show
    hostnames`` does.
    """
    hosts: List[str] = []
    for entry in _split_outside_brackets(text, name):
        pieces = re.split(r"\[([^\[\]]*)\]", entry)
        texts, groups = pieces[0::2], pieces[1::2]
        if not entry or any("[" in t or "]" in t for t in texts):
            raise ValueError(_bad_hostlist(text, name))
        choices = [_expand_group(group, text, name) for group in groups]
        for picked in itertools.product(*choices):
            hosts.append("".join(t + p for t, p in zip(texts, picked + ("",))))
    return hosts


def _split_outside_brackets(text: str, name: str) -> List[str]:
    entries, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(_bad_hostlist(text, name))
        if char == "," and depth == 0:
            entries.append(text[start:index].strip())
            start = index + 1
    if depth != 0:
        raise ValueError(_bad_hostlist(text, name))
    entries.append(text[start:].strip())
    return entries


def _expand_group(group: str, text: str, name: str) -> List[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``."""
    expanded: List[str] = []
    for part in group.split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:-([0-9]+))?\s*", part)
        if match is None:
            raise ValueError(_bad_hostlist(text, name))
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(_bad_hostlist(text, name))
        expanded.extend(str(number).zfill(len(low)) for number in range(int(low), int(high) + 1))
    return expanded


def _bad_hostlist(text: str, name: str) -> str:
    return f"{name}={text!r} is not a SLURM host list; expected a form such as 'node[01-04,07],gpu1'"
