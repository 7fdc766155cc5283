"""A seeded differential fuzzer of the calls comm stages (tests/test_fuzz.py runs it).

A case is drawn from ``(seed, index)`` alone (:func:`draw_case`): the call (every collective
and point-to-point call comm stages), who makes it (torch's function on an equipped group, or
comm's explicit one), the dtype, the reduce op, the shape, and for every tensor of every rank
its device (the CPU or the rank's NPU) and its layout (a strided view, a storage offset, a
transposed or channels_last tensor); the group (the world or a subgroup, of kind hccl, gloo
or nccl-like), async_op. So every rank regenerates every other rank's inputs and computes the
call's expected result itself, in float64 or int64 on the CPU (:func:`expected_values`).

Each case runs twice on the same ranks: *staged* (the drawn devices, on a group comm equipped)
and *control* (every tensor on the device the group's own backend serves, torch's function, a
group comm never touched). Both must match the reference, or both must refuse the case where
:func:`refusal` says the backend refuses it: an error on every rank and the caller's tensors
unchanged. A failure names the case as ``seed:index``; ``COMM_FUZZ_CASE=seed:index`` replays it
(docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8", "bool"]
REDUCE_OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
INTEGERS = {"int32", "int64", "uint8", "bool"}
# Layouts in logical order, by how often they are drawn: most tensors are plain, the rest views.
LAYOUTS = ["contiguous"] * 3 + ["strided", "offset"]
# Group kinds, and the simulation each needs: hccl and gloo groups live in one process (the
# simulated NPU with an hccl default group), the nccl-like group in a process of its own.
KINDS = {"hccl": "hccl", "gloo": "hccl", "nccl-like": "ncclsim"}
# Blocking wait: a collective that fails on the device raises from wait(), not through the watchdog.
SIMULATIONS = {"hccl": {"name": "npu", "backend": "hccl", "blocking_wait": True},
               "ncclsim": {"name": "npu", "backend": "ncclsim", "lenient": True, "blocking_wait": True}}
# The subgroup drawn beside the world, per world size: a subset where there is one.
SUBGROUP_RANKS = {2: [0, 1], 4: [0, 2, 3]}
# How long a call that waits for a rank which refused it (a bug) waits: the groups' and the store's timeout.
# 60 s: with 20 s, a rank starved of the CPU beside the integration tier's torchrun programs on two cores
# timed out (gloo's "Timed out waiting 20000ms"), and its peers' next collectives then met the wrong calls.
TIMEOUT = datetime.timedelta(seconds=60)
FLOAT_TOLERANCE = {"float32": (1.3e-6, 1e-5), "float64": (1e-7, 1e-7), "bfloat16": (1.6e-2, 1e-2),
                   "float16": (1e-3, 1e-3)}


# Where the fuzzer draws around a known disagreement, rather than testing it: one row each, with why.
# ``Case.excluded`` names the rows a case was redrawn by; tests/test_fuzz.py counts them per tier.
EXCLUSIONS = {
    "integer AVG of all_reduce_coalesced on gloo or nccl-like, drawn as SUM":
        "torch's gloo averages integers in all_reduce_coalesced without refusing them, where comm refuses the "
        "ranks it stages: the ranks would disagree and wait for each other (reported with issue 45)",
    "ranks redrawn to agree on holding a served tensor":
        "where a call is refused or run depending on whether a rank holds a tensor on the device the group's "
        "backend serves (runs_where_served), ranks that differ wait for each other until the group's timeout, "
        "not a refusal on every rank (reported with issue 45)",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn call. ``devices[r]`` and ``layouts[r]``: rank r's tensors in slot order (see :func:`slots`)."""

    seed: int
    index: int
    op: str
    api: str  # "dist": torch's function on an equipped group; "comm": comm's explicit one
    kind: str
    world: int
    group: str  # "world" or "sub"
    dtype: str
    reduce_op: Optional[str]
    shape: Tuple[int, ...]
    root: int  # group rank of a rooted call's root
    async_op: bool
    count: int  # tensors of a coalesced call
    rows: Tuple[Tuple[int, ...], ...]  # all_to_all_single: rows[i][j], rows group rank i sends to j
    sends_first: bool  # batch_isend_irecv: whether the isend comes first in each rank's list
    devices: Tuple[Tuple[str, ...], ...]  # per rank, per slot: "cpu" or "npu"
    layouts: Tuple[Tuple[str, ...], ...]
    excluded: Tuple[str, ...] = ()  # the EXCLUSIONS rows this case was redrawn by

    @property
    def id(self) -> str:
        return f"{self.seed}:{self.index}"

    @property
    def simulation(self) -> str:
        return KINDS[self.kind]

    def group_ranks(self) -> List[int]:
        return list(range(self.world)) if self.group == "world" else SUBGROUP_RANKS[self.world]

    def describe(self) -> str:
        op = f" {self.reduce_op}" if self.reduce_op else ""
        return (f"{self.api}.{self.op}{op} {self.dtype} {list(self.shape)} on {self.kind} {self.group} of "
                f"{self.world}, async={self.async_op}, devices={[list(d) for d in self.devices]}, "
                f"layouts={[list(layout) for layout in self.layouts]}")


# ---------------------------------------------------------------------------------------------
# Slots: the tensors one rank passes, in order, each with its role and shape.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Slot:
    role: str  # "in" (read), "out" (written), "inout" (both)
    shape: Tuple[int, ...]


def _rows_shape(case: Case, rows: int) -> Tuple[int, ...]:
    return (rows, *case.shape[1:])


def _coalesced_shape(case: Case, k: int) -> Tuple[int, ...]:
    """The k-th tensor of a coalesced call: the drawn shape, its first dimension grown by k (shapes differ)."""
    return (case.shape[0] + k, *case.shape[1:])


def slots(case: Case, me: int) -> List[Slot]:
    """The tensors group rank ``me`` passes to ``case``'s call, in the order the call takes them."""
    size = len(case.group_ranks())
    shape, root = case.shape, me == case.root
    inputs = [Slot("in", shape)] * size
    outputs = [Slot("out", shape)] * size
    op = case.op
    if op in ("all_reduce", "broadcast", "reduce"):
        return [Slot("inout", shape)]
    if op == "all_reduce_coalesced":
        return [Slot("inout", _coalesced_shape(case, k)) for k in range(case.count)]
    if op == "all_gather":
        return outputs + [Slot("in", shape)]
    if op == "all_gather_into_tensor":
        return [Slot("out", _rows_shape(case, shape[0] * size)), Slot("in", shape)]
    if op == "all_gather_coalesced":
        return ([Slot("out", _coalesced_shape(case, k)) for k in range(case.count) for _ in range(size)]
                + [Slot("in", _coalesced_shape(case, k)) for k in range(case.count)])
    if op == "reduce_scatter":
        return [Slot("out", shape)] + inputs
    if op == "reduce_scatter_tensor":
        return [Slot("out", shape), Slot("in", _rows_shape(case, shape[0] * size))]
    if op == "gather":
        return [Slot("in", shape)] + (outputs if root else [])
    if op == "scatter":
        return [Slot("out", shape)] + (inputs if root else [])
    if op == "all_to_all":
        return outputs + inputs
    if op == "all_to_all_single":
        received = sum(case.rows[i][me] for i in range(size))
        sent = sum(case.rows[me])
        return [Slot("out", _rows_shape(case, received)), Slot("in", _rows_shape(case, sent))]
    if op in ("send_recv", "isend_irecv", "batch_isend_irecv"):
        return [Slot("in", shape), Slot("out", shape)]
    if op == "barrier":
        return []
    raise KeyError(op)


# ---------------------------------------------------------------------------------------------
# Drawing a case.
# ---------------------------------------------------------------------------------------------

REDUCING = {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
ROOTED = {"broadcast", "reduce", "gather", "scatter"}
P2P = {"send_recv", "isend_irecv", "batch_isend_irecv"}
# Calls whose tensors are drawn dense: torch refuses a tensor that is not contiguous in them, on the rank that passes
# it, while its peers wait, and not always (gloo's isend of a strided view is refused in a ring of 2 ranks and runs
# in a ring of 3), so that no refusal can be expected of every rank.
STRICT = P2P | {"all_to_all_single"}
# The device comm stages on a group of each kind: the one its own backend does not serve. Only there are tensors
# drawn as strided views (but in STRICT calls): torch's gloo (and the simulated NPU's backends, gloo on device
# memory) read a view that is not dense as if it were, and give wrong values silently (torch 2.13: a two-rank
# gloo all_reduce of torch.zeros(6)[::2] holding [1, 2, 3] and [2, 4, 6] gives [3, 6, 3]); comm's staging copies
# the view in logical order. The control runs such tensors contiguous.
STAGED = {"hccl": "cpu", "nccl-like": "cpu", "gloo": "npu"}
SERVED = {"hccl": "npu", "nccl-like": "npu", "gloo": "cpu"}


def ops(lacks_all_to_all: bool) -> List[str]:
    """Every call the fuzzer draws: those this torch has (``lacks_all_to_all``: gloo's list all_to_all)."""
    names = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single", "send_recv",
             "isend_irecv", "batch_isend_irecv", "barrier"]
    if hasattr(dist, "all_gather_coalesced"):
        names.append("all_gather_coalesced")
    if not lacks_all_to_all:
        names.append("all_to_all")
    return names


def _draw_shape(rng: random.Random) -> Tuple[int, ...]:
    """1 to 4 dimensions (a 4-D one can be channels_last); now and then a dimension of 0."""
    shape = [rng.randint(1, 3) for _ in range(rng.choice([1, 1, 2, 2, 3, 4]))]
    if rng.random() < 0.08:
        shape[rng.randrange(len(shape))] = 0
    return tuple(shape)


# Calls that pair their tensors element by element, all of one shape: there a transposed or channels_last
# layout on every tensor of every rank means the same as a contiguous one. Elsewhere (the flat calls, which cut
# a tensor in pieces of rows) and across ranks whose layouts differ, torch's backends read memory order.
ELEMENTWISE = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
               "all_to_all"}


def _draw_permutation(rng: random.Random, op: str, shape: Tuple[int, ...]) -> Optional[str]:
    """None, or the memory order ("transposed", "channels_last") every tensor of the case gets.

    Such a case has every tensor on one device type: comm's staged copy of a transposed tensor is contiguous,
    and a backend reads memory order. HCCL and NCCL refuse a transposed tensor in place ("Tensors must be
    contiguous"), so a rank staging one while another passes it in place is a rank refused while the other
    waits: ranks that disagree on devices (docs/staging.md).
    """
    choice = rng.choice([None, None, None, "transposed", "channels_last"])
    if op not in ELEMENTWISE or choice == "transposed" and len(shape) < 2 or choice == "channels_last" and len(
            shape) != 4:
        return None
    return choice


def _draw_layout(rng: random.Random, dense: bool) -> str:
    """A layout in logical order; ``dense``: contiguous, or a contiguous view at a storage offset."""
    return rng.choice(["contiguous", "offset"] if dense else LAYOUTS)


def draw_case(seed: int, index: int, op_names: Sequence[str]) -> Case:
    """Case ``index`` of ``seed``: the same on every rank and every run."""
    rng = random.Random(f"comm-fuzz {seed}:{index}")
    op = rng.choice(sorted(op_names))
    world = rng.choice([2, 4])
    base = dict(
        seed=seed, index=index, op=op, api=rng.choice(["dist", "comm"]), kind=rng.choice(sorted(KINDS)),
        world=world, group=rng.choice(["world", "world", "sub"]), dtype=rng.choice(DTYPES),
        reduce_op=rng.choice(REDUCE_OPS) if op in REDUCING else None, shape=_draw_shape(rng),
        async_op=rng.random() < 0.4, count=rng.randint(1, 3), sends_first=rng.random() < 0.5,
        root=0, rows=(), devices=(), layouts=())
    case = Case(**base)  # type: ignore[arg-type]
    excluded = []
    if op == "all_reduce_coalesced" and case.dtype in INTEGERS and case.kind != "hccl" and case.reduce_op == "AVG":
        excluded.append("integer AVG of all_reduce_coalesced on gloo or nccl-like, drawn as SUM")
        case = dataclasses.replace(case, reduce_op="SUM")
    size = len(case.group_ranks())
    uneven = op == "all_to_all_single" and rng.random() < 0.5
    rows = tuple(tuple(rng.randint(0, 2) if uneven else case.shape[0] for _ in range(size)) for _ in range(size))
    case = dataclasses.replace(case, root=rng.randrange(size) if op in ROOTED else 0, rows=rows)
    mixed = rng.random() < 0.5  # else one device for all of a rank's tensors
    # EXCLUSIONS: where a rank's call is refused or run depending on whether it holds a tensor on the served
    # device (see runs_where_served), the ranks agree on that.
    any_served = rng.random() < 0.5 if runs_where_served(case) else None
    served, staged = SERVED[case.kind], STAGED[case.kind]
    permutation = _draw_permutation(rng, op, case.shape)
    one_device = rng.choice(["cpu", "npu"]) if permutation else None
    devices, layouts = [], []
    for rank in range(world):
        me = case.group_ranks().index(rank) if rank in case.group_ranks() else None
        count = len(slots(case, me)) if me is not None else 0
        first = rng.choice(["cpu", "npu"])
        drawn = [one_device or (rng.choice(["cpu", "npu"]) if mixed else first) for _ in range(count)]
        if any_served is False or any_served and count and served not in drawn:
            agreeing = [served if any_served and k == 0 else staged for k in range(count)]
            if agreeing != drawn and "ranks redrawn to agree on holding a served tensor" not in excluded:
                excluded.append("ranks redrawn to agree on holding a served tensor")
            drawn = agreeing
        devices.append(tuple(drawn))
        if permutation:  # on one device type: see _draw_permutation
            layouts.append(tuple(permutation for _ in drawn))
        else:  # a strided view only where comm stages it: see STAGED
            layouts.append(tuple(_draw_layout(rng, op in STRICT or device != STAGED[case.kind]) for device in drawn))
    return dataclasses.replace(case, devices=tuple(devices), layouts=tuple(layouts), excluded=tuple(excluded))


def gloo_fallback(case: Case) -> bool:
    """Whether ``case`` is a reduction HCCL cannot run, which comm stages on a gloo communicator of its own where a
    rank's tensors are all on the CPU (docs/staging.md): float64, and bool or uint8 in a reduce-scatter."""
    reduce_scatters = ("reduce_scatter", "reduce_scatter_tensor")
    return case.kind == "hccl" and case.op in REDUCING and (
        case.dtype == "float64" or case.dtype in ("bool", "uint8") and case.op in reduce_scatters)


def runs_where_served(case: Case) -> bool:
    """Whether a rank's call in ``case`` is refused or run depending on whether the rank holds a tensor on the
    device the group's backend serves (which then runs the call, through the mixed-device kernel where the
    rank's tensors mix devices) or none (comm's staging backend runs it):

    * on hccl, a gloo fallback or all_gather_coalesced (which HCCL lacks, and comm stages as one flat
      all-gather): HCCL refuses them, comm stages them;
    * elsewhere, an integer AVG: gloo (the nccl-like backend's too) starts it and raises after its SUM,
      comm refuses it before anything is sent.

    Where the ranks differ, those that run the call wait for the others until the group's timeout: not a
    refusal on every rank (reported with issue 45). So the ranks of such a case agree.
    """
    if case.kind == "hccl":
        return gloo_fallback(case) or case.op == "all_gather_coalesced"
    return case.reduce_op == "AVG" and case.dtype in INTEGERS


# ---------------------------------------------------------------------------------------------
# Values: what each rank's tensors hold before the call, and what they must hold after it.
# ---------------------------------------------------------------------------------------------

def initial_values(case: Case, me: int) -> List[torch.Tensor]:
    """Group rank ``me``'s tensors before the call, in float64 (floats), int64 (integers) or bool.

    Small values (halves from -3 to 3, integers from -4 to 4, 0 to 3 unsigned) keep sums and
    products of up to four ranks exact in every dtype, bfloat16 included.
    """
    generator = torch.Generator().manual_seed((case.seed * 1_000_003 + case.index) * 64 + me)
    values = []
    for slot in slots(case, me):
        if case.dtype == "bool":
            values.append(torch.randint(0, 2, slot.shape, generator=generator).bool())
        elif case.dtype == "uint8":
            values.append(torch.randint(0, 4, slot.shape, generator=generator))
        elif case.dtype.startswith("int"):
            values.append(torch.randint(-4, 5, slot.shape, generator=generator))
        else:
            values.append(torch.randint(-6, 7, slot.shape, generator=generator).double() / 2)
    return values


def _reduce(values: List[torch.Tensor], op: str, dtype: str) -> torch.Tensor:
    """``op`` over one tensor per rank, computed exactly; bool as the backends reduce it (SUM and MAX: or).

    The oracle's own reading of the backends, kept apart from comm's (StagedCall::reduceOp, comm/gaps.py) and
    the simulation's (comm/testing/csrc/backend.cpp) on purpose: a rule read wrong in one of them shows here.
    """
    stacked = torch.stack([v.long() if v.dtype == torch.bool else v for v in values])
    if op == "SUM":
        result = stacked.sum(0)
    elif op == "AVG" and dtype in INTEGERS:  # HCCL's: floor division, as Ascend's own tests expect
        result = torch.div(stacked.sum(0), len(values), rounding_mode="floor")
    elif op == "AVG":
        result = stacked.double().sum(0) / len(values)
    elif op == "MAX":
        result = stacked.max(0).values if stacked.numel() else stacked.sum(0)
    elif op == "MIN":
        result = stacked.min(0).values if stacked.numel() else stacked.sum(0)
    else:
        result = stacked.prod(0)
    return result != 0 if dtype == "bool" else result


UNSPECIFIED = "unspecified"  # a tensor whose content torch leaves undefined after the call (reduce's non-roots)


def expected_values(case: Case, me: int) -> List[Any]:
    """What group rank ``me``'s tensors hold after the call: a tensor, or UNSPECIFIED, per slot."""
    size = len(case.group_ranks())
    every = [initial_values(case, r) for r in range(size)]
    mine = list(every[me])
    op, red = case.op, case.reduce_op
    if op in ("all_reduce", "all_reduce_coalesced"):
        return [_reduce([v[k] for v in every], red, case.dtype) for k in range(len(mine))]
    if op == "broadcast":
        return [every[case.root][0]]
    if op == "reduce":
        return [_reduce([v[0] for v in every], red, case.dtype)] if me == case.root else [UNSPECIFIED]
    if op == "all_gather":
        return [every[r][size] for r in range(size)] + mine[size:]
    if op == "all_gather_into_tensor":
        return [torch.cat([every[r][1] for r in range(size)]), mine[1]]
    if op == "all_gather_coalesced":
        k_inputs = slice(case.count * size, None)
        return [every[r][k_inputs][k] for k in range(case.count) for r in range(size)] + mine[k_inputs]
    if op == "reduce_scatter":
        return [_reduce([v[1 + me] for v in every], red, case.dtype)] + mine[1:]
    if op == "reduce_scatter_tensor":
        rows = case.shape[0]
        return [_reduce([v[1][me * rows:(me + 1) * rows] for v in every], red, case.dtype), mine[1]]
    if op == "gather":
        return mine[:1] + ([every[r][0] for r in range(size)] if me == case.root else [])
    if op == "scatter":
        return [every[case.root][1 + me]] + mine[1:]
    if op == "all_to_all":
        return [every[r][size + me] for r in range(size)] + mine[size:]
    if op == "all_to_all_single":
        pieces = [every[i][1][sum(case.rows[i][:me]):sum(case.rows[i][:me + 1])] for i in range(size)]
        return [torch.cat(pieces), mine[1]]
    if op in P2P:
        return [mine[0], every[(me - 1) % size][0]]
    return []


# ---------------------------------------------------------------------------------------------
# Refusals: the cases the group's backend (or comm) must refuse, on every rank, writing nothing.
# ---------------------------------------------------------------------------------------------

def _on_hccl(case: Case, variant: str) -> bool:
    """Whether HCCL itself runs ``case``: on an hccl group, the control (every tensor on the NPU), or a staged
    case in which some rank holds an NPU tensor (where that decides, every rank does: see runs_where_served)."""
    if case.kind != "hccl":
        return False
    return variant == "control" or any("npu" in devices for devices in case.devices)


def refusal(case: Case, variant: str) -> Optional[str]:
    """Why ``case`` must be refused when run as ``variant`` ("staged" or "control"), or None when it must run.

    The oracle's own reading (see ``_reduce``): which backend averages integers, what HCCL cannot run.
    """
    if case.reduce_op == "AVG" and case.dtype in INTEGERS and (
            case.kind != "hccl" or case.dtype == "bool" or gloo_fallback(case)):
        return "AVG of integers where gloo divides in floating point, or of bools (HCCL averages other integers)"
    if _on_hccl(case, variant):
        if gloo_fallback(case):
            return f"HCCL cannot {case.op} {case.dtype}"
        if case.op == "all_gather_coalesced":
            return "HCCL has no allgather_coalesced"
        if case.op != "all_to_all" and not all(_dense(case.shape, layout) for ls in case.layouts for layout in ls):
            return "HCCL takes dense tensors only (Tensors must be contiguous)"
    return None


def _dense(shape: Tuple[int, ...], layout: str) -> bool:
    """Whether a tensor of ``shape`` in ``layout`` is contiguous in its suggested memory format, as HCCL checks
    (a transposed view of a dimension of size 1 is). Strided views never reach HCCL here: see STAGED."""
    if layout not in ("transposed", "channels_last"):
        return True
    tensor = place(torch.zeros(shape), torch.float32, torch.device("cpu"), layout)
    return tensor.is_contiguous() or tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)


def _written_by_torch(case: Case, tensor: torch.Tensor) -> bool:
    """Whether torch itself writes ``tensor`` before refusing ``case``: gloo's AVG of integers (and the nccl-like
    backend's, which is gloo's) raises only after its SUM landed in the tensors it serves. comm refuses the
    tensors it stages before copying them."""
    return (case.kind != "hccl" and case.reduce_op == "AVG" and case.dtype in INTEGERS
            and tensor.device.type == SERVED[case.kind])


# ---------------------------------------------------------------------------------------------
# Running a case on one rank.
# ---------------------------------------------------------------------------------------------

def place(value: torch.Tensor, dtype: torch.dtype, device: torch.device, layout: str) -> torch.Tensor:
    """``value`` as a tensor of ``dtype`` on ``device`` with ``layout``'s strides and storage offset."""
    shape = tuple(value.shape)
    if layout == "strided":  # every other element of a buffer twice as wide
        tensor = torch.zeros(*shape[:-1], shape[-1] * 2, dtype=dtype, device=device)[..., ::2]
    elif layout == "offset":  # a view three elements into its storage
        tensor = torch.zeros(value.numel() + 3, dtype=dtype, device=device)[3:].view(shape)
    elif layout == "transposed":
        tensor = torch.zeros(*shape[:-2], shape[-1], shape[-2], dtype=dtype, device=device).transpose(-1, -2)
    elif layout == "channels_last":
        tensor = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    else:
        tensor = torch.zeros(shape, dtype=dtype, device=device)
    tensor.copy_(value.to(dtype))
    return tensor


def _p2p_peers(case: Case, me: int) -> Tuple[int, int]:
    """The global ranks group rank ``me`` sends to (the next) and receives from (the previous), in a ring."""
    ranks = case.group_ranks()
    return ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]


def _issue(module: Any, case: Case, me: int, tensors: List[torch.Tensor], group: Any) -> List[Any]:
    """Make ``case``'s call with ``module`` (torch.distributed or comm); return the works to wait on."""
    ranks, size = case.group_ranks(), len(case.group_ranks())
    a, root = case.async_op, ranks[case.root]
    op = getattr(dist.ReduceOp, case.reduce_op) if case.reduce_op else None
    name = case.op
    if name == "all_reduce":
        works = [module.all_reduce(tensors[0], op, group, a)]
    elif name == "all_reduce_coalesced":
        works = [module.all_reduce_coalesced(tensors, op, group, a)]
    elif name == "broadcast":
        works = [module.broadcast(tensors[0], root, group, a)]
    elif name == "reduce":
        works = [module.reduce(tensors[0], root, op, group, a)]
    elif name == "all_gather":
        works = [module.all_gather(tensors[:size], tensors[size], group, a)]
    elif name == "all_gather_into_tensor":
        works = [module.all_gather_into_tensor(tensors[0], tensors[1], group, a)]
    elif name == "all_gather_coalesced":
        outputs = [[tensors[k * size + r] for k in range(case.count)] for r in range(size)]  # one list per rank
        works = [module.all_gather_coalesced(outputs, tensors[case.count * size:], group, a)]
    elif name == "reduce_scatter":
        works = [module.reduce_scatter(tensors[0], tensors[1:], op, group, a)]
    elif name == "reduce_scatter_tensor":
        works = [module.reduce_scatter_tensor(tensors[0], tensors[1], op, group, a)]
    elif name == "gather":
        works = [module.gather(tensors[0], tensors[1:] if me == case.root else None, root, group, a)]
    elif name == "scatter":
        works = [module.scatter(tensors[0], tensors[1:] if me == case.root else None, root, group, a)]
    elif name == "all_to_all":
        works = [module.all_to_all(tensors[:size], tensors[size:], group, a)]
    elif name == "all_to_all_single":
        received = [case.rows[i][me] for i in range(size)]
        works = [module.all_to_all_single(tensors[0], tensors[1], received, list(case.rows[me]), group, a)]
    elif name == "barrier":
        works = [module.barrier(group, a)]
    else:
        works = _issue_p2p(module, case, me, tensors, group)
    return [work for work in works if work is not None]


def _issue_p2p(module: Any, case: Case, me: int, tensors: List[torch.Tensor], group: Any) -> List[Any]:
    after, before = _p2p_peers(case, me)
    sent, received = tensors
    if case.op == "send_recv":  # even group ranks send first, odd ones receive first: nobody waits for ever
        steps = [lambda: module.send(sent, after, group), lambda: module.recv(received, before, group)]
        for step in steps if me % 2 == 0 else steps[::-1]:
            step()
        return []
    if case.op == "isend_irecv":
        return [module.isend(sent, after, group), module.irecv(received, before, group)]
    op_class = module.P2POp
    ops = [op_class(module.isend, sent, after, group), op_class(module.irecv, received, before, group)]
    return list(module.batch_isend_irecv(ops if case.sends_first else ops[::-1]))


def _outcome(call: Callable[[], List[Any]]) -> Optional[str]:
    """Run the call and wait for its works; None, or the error it raised as "Type: message"."""
    try:
        for work in call():
            work.wait()
    except Exception as error:  # noqa: BLE001 - compared with what the case expects
        return f"{type(error).__name__}: {error}"
    return None


def _matches(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    if got.shape != want.shape:
        return False
    if dtype in FLOAT_TOLERANCE:
        rtol, atol = FLOAT_TOLERANCE[dtype]
        return torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol)
    return torch.equal(got.to(torch.int64), want.to(torch.int64))


def _facts(tensor: torch.Tensor) -> Tuple[Any, ...]:
    """What write-back must keep of a caller's tensor: its memory, device, dtype, shape and strides."""
    return (tensor.data_ptr(), str(tensor.device), tensor.dtype, tuple(tensor.shape), tensor.stride(),
            tensor.storage_offset())


def run_case(case: Case, variant: str, rank: int, group: Any) -> Dict[str, Any]:
    """Run ``case`` on this rank as ``variant``; its outcome (None: ran) and what was wrong."""
    import comm

    me = case.group_ranks().index(rank)
    dtype = getattr(torch, case.dtype)
    npu = torch.device("npu", rank)
    served = torch.device("cpu") if case.kind == "gloo" else npu
    before = initial_values(case, me)
    layouts = case.layouts[rank]
    if variant == "control":  # every tensor where the group's backend serves it, and dense (see STAGED)
        devices = [served] * len(before)
        layouts = tuple("contiguous" if layout == "strided" else layout for layout in layouts)
    else:
        devices = [npu if d == "npu" else torch.device("cpu") for d in case.devices[rank]]
    tensors = [place(v, dtype, d, layout) for v, d, layout in zip(before, devices, layouts)]
    facts = [_facts(t) for t in tensors]
    module = comm if variant == "staged" and case.api == "comm" else dist
    started = time.monotonic()
    outcome = _outcome(lambda: _issue(module, case, me, tensors, group))
    problems = []
    if time.monotonic() - started > TIMEOUT.total_seconds() / 2:  # a refusal is prompt; this rank waited for others
        problems.append(f"took {time.monotonic() - started:.0f} s: the ranks did not make the same call")
    if [_facts(t) for t in tensors] != facts:
        problems.append("a caller's tensor changed its memory, device, dtype, shape or strides")
    after = [t.cpu() for t in tensors]
    why = refusal(case, variant)
    if why is not None:
        if outcome is None:
            problems.append(f"ran, but must be refused ({why})")
        elif not outcome.startswith(("RuntimeError", "ValueError")):
            problems.append(f"refused with {outcome}, not a RuntimeError or ValueError")
        elif any(not _matches(a, b, case.dtype) and not _written_by_torch(case, t) for a, b, t in
                 zip(after, before, tensors)):
            problems.append(f"refused ({outcome}) but wrote into the caller's tensors")
        return {"outcome": outcome, "problems": problems}
    if outcome is not None:
        problems.append(f"raised {outcome}")
        return {"outcome": outcome, "problems": problems}
    for k, (got, want) in enumerate(zip(after, expected_values(case, me))):
        if want is UNSPECIFIED:
            continue
        if got.dtype != dtype or not _matches(got, want, case.dtype):
            problems.append(f"tensor {k} ({slots(case, me)[k].role}): got {got.tolist()}, expected {want.tolist()}")
    return {"outcome": outcome, "problems": problems}


# ---------------------------------------------------------------------------------------------
# One rank of a batch: its groups, then every case, staged and control.
# ---------------------------------------------------------------------------------------------

def _groups(simulation: str, world: int) -> Dict[Tuple[str, str, str], Any]:
    """Every group a batch needs, by (kind, "world" or "sub", variant): those the staged variant uses
    equipped by comm, the control's never touched by comm. Every rank makes them all, in one order."""
    import comm

    everyone, sub = list(range(world)), SUBGROUP_RANKS[world]
    kinds = [kind for kind, needs in KINDS.items() if needs == simulation]
    groups = {}
    for kind in kinds:
        backend = "gloo" if kind == "gloo" else None  # None: the default group's backend
        for name, ranks in (("world", everyone), ("sub", sub)):
            for variant in ("staged", "control"):
                groups[kind, name, variant] = dist.new_group(ranks, backend=backend, timeout=TIMEOUT)
    for (_, _, variant), group in groups.items():
        if variant == "staged" and group != dist.GroupMember.NON_GROUP_MEMBER:
            comm.equip(group)
    return groups


def rank_main(rank: int, world: int, cases: Sequence[Case]) -> List[Tuple[str, str, Dict[str, Any]]]:
    """run_ranks' function: every case of one batch (one simulation, one world size) on this rank.

    A barrier on a gloo group of comm's never-equipped world follows each run, so that a case
    that hangs or errs on one rank alone does not shift every later case.
    """
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations of the calls it fuzzes
    warnings.filterwarnings("ignore", category=UserWarning)
    simulation = cases[0].simulation
    dist.distributed_c10d._get_default_store().set_timeout(TIMEOUT)  # where comm's communicators meet too
    groups = _groups(simulation, world)
    referee = dist.new_group(list(range(world)), backend="gloo")
    reports = []
    for case in cases:
        for variant in ("staged", "control"):
            if rank in case.group_ranks():
                group = groups[case.kind, case.group, variant]
                reports.append((case.id, variant, run_case(case, variant, rank, group)))
            dist.barrier(referee)
    return reports
