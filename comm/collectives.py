"""comm's explicit collectives and point-to-point calls: torch.distributed's, on any device.

Each ``comm.<name>`` has exactly torch's signature and return value, and calls
torch's own function once the group is equipped with comm's staging backend
(:mod:`comm.slot`), which c10d then hands the tensors of unserved devices to.
What they add to torch's: the group is equipped at its first call, so code that
created it without comm still stages; ``ReduceOp.AVG`` runs as SUM then divide
where the group's backend lacks it (:mod:`comm.gaps`); ``all_gather`` takes
pieces of unequal sizes on every backend. A call whose tensors lie on different
devices (an NPU input gathered into CPU outputs) is staged by comm's C++ kernel in
front of c10d's, as torch's own call is (comm/csrc/mixed_devices.cpp). Where the
staging backend cannot be built, comm's calls stage in plain Python
(:mod:`comm.python_staging`).

:data:`COLLECTIVES` describes each call once: the arguments it reads and those it
writes, and what :func:`comm.profile` counts of it (its message, as nccl-tests
counts it, the bus factor, whether it always returns a work). Everything else about
a call is torch's.

What a call costs over torch's own: each function is written at import from its row
of the table and torch's signature (no per-call binding). A call on a group whose
facts it has learnt (the group is equipped, and no gap of the call can apply there:
:data:`_FAST`, :data:`_FAST_IF_SPARED`, learnt at the first call of each name on each
group) is one identity test or dict read and torch's function, whatever its tensors. Every
other call takes :func:`_general`, which checks everything.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from comm import gaps, python_staging, slot

# torch's private names used here, with why: comm/_torch_private.py (the one list).


def _once(ranks: int) -> float:
    """Bus over algorithm bandwidth where the message crosses each link once: broadcast, reduce, point-to-point."""
    return 1.0


def _ring(ranks: int) -> float:
    """Bus over algorithm bandwidth where (n-1)/n of the message travels: the piece a rank keeps never does
    (all_gather, reduce_scatter, all_to_all, gather, scatter)."""
    return (ranks - 1) / ranks


def _ring_twice(ranks: int) -> float:
    """Bus over algorithm bandwidth of all_reduce: a reduce_scatter then an all_gather, each byte twice round."""
    return 2 * _ring(ranks)


class Collective(NamedTuple):
    """What a call does with its tensors, by torch's parameter names, and what a profile counts of it.

    ``reads`` and ``writes``: the arguments whose tensors it reads and writes (what
    staging copies in and back). The rest is for :func:`comm.profile`, as nccl-tests
    counts: ``message`` is the argument whose bytes are the message, the whole
    gathered, reduced-then-scattered or exchanged buffer (None: no message, as
    barrier's); ``message_per_rank`` that it holds one rank's piece, so the message
    is the ranks times it (gather's and scatter's ``tensor``); ``bus_factor`` the bus
    bandwidth over the algorithm bandwidth on n ranks; ``always_async`` that the
    call returns a work whatever its arguments (no ``async_op``), so it is timed
    until that work is waited on.
    """

    reads: Tuple[str, ...]
    writes: Tuple[str, ...]
    message: Optional[str] = "tensor"
    message_per_rank: bool = False
    bus_factor: Callable[[int], float] = _once
    always_async: bool = False


COLLECTIVES: Dict[str, Collective] = {
    "all_reduce": Collective(("tensor",), ("tensor",), bus_factor=_ring_twice),
    "all_reduce_coalesced": Collective(("tensors",), ("tensors",), message="tensors", bus_factor=_ring_twice),
    "broadcast": Collective(("tensor",), ("tensor",)),
    "reduce": Collective(("tensor",), ("tensor",)),
    "all_gather": Collective(("tensor",), ("tensor_list",), message="tensor_list", bus_factor=_ring),
    "all_gather_into_tensor": Collective(("input_tensor",), ("output_tensor",), message="output_tensor",
                                         bus_factor=_ring),
    "all_gather_single": Collective(("input_tensor",), ("output_tensor",), message="output_tensor", bus_factor=_ring),
    "all_gather_coalesced": Collective(("input_tensor_list",), ("output_tensor_lists",),
                                       message="output_tensor_lists", bus_factor=_ring),
    "reduce_scatter": Collective(("input_list",), ("output",), message="input_list", bus_factor=_ring),
    "reduce_scatter_tensor": Collective(("input",), ("output",), message="input", bus_factor=_ring),
    "reduce_scatter_single": Collective(("input",), ("output",), message="input", bus_factor=_ring),
    "gather": Collective(("tensor",), ("gather_list",), message_per_rank=True, bus_factor=_ring),
    "scatter": Collective(("scatter_list",), ("tensor",), message_per_rank=True, bus_factor=_ring),
    "all_to_all": Collective(("input_tensor_list",), ("output_tensor_list",), message="input_tensor_list",
                             bus_factor=_ring),
    "all_to_all_single": Collective(("input",), ("output",), message="input", bus_factor=_ring),
    "barrier": Collective((), (), message=None),
    "send": Collective(("tensor",), ()),
    "isend": Collective(("tensor",), (), always_async=True),
    "recv": Collective((), ("tensor",)),
    "irecv": Collective((), ("tensor",), always_async=True),
    # Its message: the tensors its P2POps hold.
    "batch_isend_irecv": Collective((), (), message="p2p_op_list", always_async=True),
}
# torch.distributed's own function for each, captured at import. Where this torch
# lacks the *_single names (before 2.12), their older names stand in.
_OLDER_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


# The function each of comm's calls runs, by name: torch's own, or what retarget() put in its place.
_TARGETS: Dict[str, Callable[..., Any]] = {
    name: getattr(dist, name, None) or getattr(dist, _OLDER_NAMES.get(name, name)) for name in COLLECTIVES}
TORCH: Mapping[str, Callable[..., Any]] = types.MappingProxyType(_TARGETS)


def retarget(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """Make comm's ``name`` run ``function`` in place of torch's (torch's own puts it back); return what it ran.

    For comm.profile(), which times comm's calls so while a profile is open. Each of comm's
    functions reads what it runs from a namespace of its own (see :func:`_explicit`):
    this points that namespace, and :data:`TORCH`, at ``function``.
    """
    if name not in _TARGETS:
        raise KeyError(f"comm has no call named {name!r}")
    previous = _TARGETS[name]
    _TARGETS[name] = function
    namespace = _EXPLICIT[name].__globals__
    namespace["target"], namespace["logs"] = _body(function)
    namespace["torch_function"] = function
    return previous


# Per call and group, the facts that let a call skip comm's checks, learnt at the first
# call of each name on each group: the group is equipped (so c10d routes every
# device), and no gap of the call applies there (_FAST), or none when the call passes
# the gap's sparing value (_FAST_IF_SPARED: ReduceOp.SUM where the group's backend lacks AVG).
# Keyed by id(group) beside a weak reference whose callback removes the entry when the
# group is collected (before its id can name another object): comm keeps no group
# alive. Each function also holds a weak reference to the default group it learnt
# (fast_default, spared_default in its namespace): an identity test per call.
_FAST: Dict[str, Dict[int, Any]] = {name: {} for name in COLLECTIVES}
_FAST_IF_SPARED: Dict[str, Dict[int, Any]] = {name: {} for name in COLLECTIVES}
_LEARNT = threading.RLock()  # reentrant: a collection inside _learn may run _forget


class _NotLearnt:
    """What a function's weak reference to its default group gives before it learns one: no group."""


_NOT_LEARNT = _NotLearnt()
_NOT_LEARNT_REF = weakref.ref(_NOT_LEARNT)
_EXPLICIT: Dict[str, Callable[..., Any]] = {}
# Inside torch.compile, comm's calls are torch's: dynamo maps torch's own function (by
# identity) to a functional collective. A folded constant to dynamo, one Python call
# otherwise (torch.compiler.is_compiling makes two).
_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
try:
    import torch.distributed.c10d_logger as _c10d_logger

    _LOGGER_CODE: Any = _c10d_logger._exception_logger(lambda: None).__code__
    _c10d_logger._get_msg_dict, _c10d_logger._c10d_logger  # noqa: B018 - what comm's log calls, present
except (ImportError, AttributeError):  # a torch whose functions are wrapped otherwise: comm calls them as they are
    _LOGGER_CODE = None

# The source of each of comm's calls, written from its row of COLLECTIVES and torch's
# signature. A call on a group whose facts are learnt (one identity test for the
# default group, one dict read for another) runs torch's function as it is, whatever
# devices its tensors lie on (comm's C++ stages what mixes them); any other goes to
# _general, which checks everything. Where torch's function is its body
# wrapped in torch's exception logger (c10d_logger._exception_logger), comm's function
# takes that wrapper's place: it runs the body and logs a failure as the wrapper does,
# so that a call through comm has as many Python frames as torch's own (c10d records
# the Python stack of every collective; each frame costs it time). Each function has a
# namespace of its own as its globals, read faster than a closure's cells.
def _source(name: str, parameters: List[inspect.Parameter]) -> str:
    """The source of comm's ``name``, whose defaults are named ``default_<parameter>`` (torch's, as objects)."""
    names = [p.name for p in parameters]
    signature = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}=default_{p.name}"
                          for p in parameters)
    positional = ", ".join(names)
    lines = [f"def {name}({signature}):",
             "    if compiling():  # torch's call, which dynamo knows, and no check in the graph",
             f"        return given(torch_function, defaults, {', '.join(f'{n}={n}' for n in names)})"]
    if "group" in names or name == "batch_isend_irecv":
        gap = gaps.GAPS.get(name)
        spare = f"{gap.spared_by[0]} is spare" if gap is not None and gap.spared_by is not None else ""
        if "group" not in names:  # batch_isend_irecv: the group of its first operation, as torch reads it
            lines += ["    try:",
                      "        group = p2p_op_list[0].group",
                      "    except (IndexError, TypeError, AttributeError):  # torch's call says what is wrong",
                      f"        return general({', '.join(f'{n}={n}' for n in names)})"]
        lines += [
            "    if group is None:  # the default group: learnt once, an identity test",
            "        fast = world._default_pg is fast_default()" + (
                f" or ({spare} and world._default_pg is spared_default())" if spare else ""),
            "    else:",
            "        fast = id(group) in fast_groups" + (
                f" or ({spare} and id(group) in spared_groups)" if spare else ""),
            "    if fast:",
            "        try:",
            f"            return target({positional})",
            "        except Exception as error:",
            *([f"            if refused(error, {', '.join(f'{n}={n}' for n in names)}):  # what comm fills",
               f"                return general({', '.join(f'{n}={n}' for n in names)})"]
              if gap is not None and gap.refused is not None else []),
            "            if logs:",
            "                log(error, group)",
            "            raise",
        ]
    # torch's exception logger describes the group a call names by keyword: hand it every argument so.
    lines += [f"    return general({', '.join(f'{n}={n}' for n in names)})"]
    return "\n".join(lines) + "\n"


def _body(function: Callable[..., Any]) -> Tuple[Callable[..., Any], bool]:
    """What comm's fast path calls for ``function``, and whether it logs the failures: torch's function body and
    True where ``function`` is that body in torch's exception logger; else ``function`` itself and False."""
    code = getattr(function, "__code__", None)
    body = getattr(function, "__wrapped__", None)  # set by the logger's functools.wraps
    if _LOGGER_CODE is None or code is not _LOGGER_CODE or body is None:
        return function, False
    return body, True


def _logged(name: str) -> Callable[[Exception, Any], None]:
    """What torch's exception logger does when the body of ``name`` fails (c10d_logger._exception_logger)."""

    def log(error: Exception, group: Any) -> None:
        msg_dict = _c10d_logger._get_msg_dict(name, group=group)
        msg_dict["error"] = f"{error}"
        _c10d_logger._c10d_logger.debug(msg_dict)

    return log


def _explicit(name: str) -> Callable[..., Any]:
    """comm's ``name``: torch's function, once the group it runs on is equipped, with comm's additions.

    Written at import from torch's signature, with no per-call binding: a call on a
    group whose facts are learnt (:data:`_FAST`) is one dict read and torch's call.
    """
    torch_call = TORCH[name]
    signature = inspect.signature(torch_call)
    parameters = list(signature.parameters.values())
    gap = gaps.GAPS.get(name)
    target, logs = _body(torch_call)
    namespace: Dict[str, Any] = {
        "target": target, "logs": logs, "log": _logged(getattr(target, "__name__", name)),
        "torch_function": torch_call, "given": _given, "general": functools.partial(_general, name),
        "defaults": {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty},
        "fast_groups": _FAST[name],
        "spared_groups": _FAST_IF_SPARED[name], "fast_default": _NOT_LEARNT_REF, "spared_default": _NOT_LEARNT_REF,
        "world": _world,
        "compiling": _dynamo_compiling,
        "spare": gap.spared_by[1] if gap is not None and gap.spared_by is not None else None,
        "refused": gap.refused if gap is not None else None,
        **{f"default_{p.name}": p.default for p in parameters if p.default is not inspect.Parameter.empty},
    }
    source, filename = _source(name, parameters), f"<comm.{name}>"
    # The source where tracebacks, inspect.getsource and debuggers look for a file's lines
    # (no modification time: linecache.checkcache keeps the entry).
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - from the table
    explicit: Callable[..., Any] = namespace[name]
    explicit.__module__ = __name__
    explicit.__qualname__ = name
    explicit.__doc__ = torch_call.__doc__
    explicit.__comm_name__ = name  # type: ignore[attr-defined]
    # torch's signature, annotations included, for help() and inspect; no __wrapped__:
    # dynamo would take the function for torch's own and not trace into it.
    explicit.__signature__ = signature  # type: ignore[attr-defined]
    _EXPLICIT[name] = explicit
    return explicit


def _given(function: Callable[..., Any], defaults: Dict[str, Any], **arguments: Any) -> Any:
    """``function`` called with the arguments that are not their defaults: as a caller who omitted those would.

    For dynamo, which maps torch's call to a functional collective whose defaults
    differ (isend's ``group_dst``): an argument the caller did not pass must stay unpassed.
    """
    return function(**{key: value for key, value in arguments.items()
                       if key not in defaults or value is not defaults[key]})


def _general(name: str, **kwargs: Any) -> Any:
    """Every call of ``name`` whose facts are not learnt, or that may need comm: all checks, then torch's call."""
    torch_call = TORCH[name]
    if torch.compiler.is_compiling():
        return torch_call(**kwargs)  # dynamo or export turns it into a functional collective
    gap = gaps.GAPS.get(name)
    group = _group_of(name, kwargs)
    if slot.equipped_once(group):
        _learn(name, group, gap)
        return torch_call(**kwargs) if gap is None else gap.call(torch_call, (), kwargs)
    call = torch_call if gap is None else functools.partial(_fill, gap, torch_call)
    return python_staging.run(name, COLLECTIVES[name], torch_call, call, kwargs)


def _group_of(name: str, kwargs: Dict[str, Any]) -> Any:
    """The group a call runs on (None for the default group): its ``group``, or its first P2POp's."""
    if name != "batch_isend_irecv":
        return kwargs.get("group")
    ops = kwargs.get("p2p_op_list")
    return ops[0].group if isinstance(ops, list) and ops and isinstance(ops[0], dist.P2POp) else None


def _learn(name: str, group: Any, gap: Optional[gaps.Gap]) -> None:
    """Record that calls of ``name`` on ``group`` (equipped) need no check: always, or when they pass the gap's
    sparing value; until the group is collected."""
    pg = _world._default_pg if group is None else group
    if not isinstance(pg, dist.ProcessGroup) or id(pg) in _FAST[name] or id(pg) in _FAST_IF_SPARED[name]:
        return
    if gap is None or not gap.needed_on(pg):
        table, default = _FAST[name], "fast_default"
    elif gap.spared_by is not None:
        table, default = _FAST_IF_SPARED[name], "spared_default"
    else:
        return
    with _LEARNT:
        table[id(pg)] = weakref.ref(pg, functools.partial(_forget, table, id(pg)))
        if pg is _world._default_pg:
            namespace = _EXPLICIT[name].__globals__
            namespace[default] = weakref.ref(pg, functools.partial(_forget_default, namespace, default))


def _forget(table: Dict[int, Any], key: int, collected: Any) -> None:
    with _LEARNT:
        if table.get(key) is collected:
            del table[key]


def _forget_default(namespace: Dict[str, Any], default: str, collected: Any) -> None:
    with _LEARNT:
        if namespace[default] is collected:
            namespace[default] = _NOT_LEARNT_REF


def _fill(gap: gaps.Gap, torch_call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return gap.call(torch_call, args, kwargs)


def _torch_op(op: Any) -> Any:
    """torch's isend or irecv (as torch.distributed holds it now) for comm's; any other op as it is.

    Told apart by the name each of comm's calls carries, which dynamo reads as it
    traces (a P2POp built inside a compiled function).
    """
    name = getattr(op, "__comm_name__", None)
    return op if name is None else getattr(dist, name)


def P2POp(op: Any, *args: Any, **kwargs: Any) -> dist.P2POp:  # noqa: N802 - torch's name for what it builds
    """torch's ``P2POp`` (its arguments), also built with ``comm.isend`` or ``comm.irecv``."""
    return dist.P2POp(_torch_op(op), *args, **kwargs)


all_reduce = _explicit("all_reduce")
all_reduce_coalesced = _explicit("all_reduce_coalesced")
broadcast = _explicit("broadcast")
reduce = _explicit("reduce")
all_gather = _explicit("all_gather")
all_gather_into_tensor = _explicit("all_gather_into_tensor")
all_gather_single = _explicit("all_gather_single")
all_gather_coalesced = _explicit("all_gather_coalesced")
reduce_scatter = _explicit("reduce_scatter")
reduce_scatter_tensor = _explicit("reduce_scatter_tensor")
reduce_scatter_single = _explicit("reduce_scatter_single")
gather = _explicit("gather")
scatter = _explicit("scatter")
all_to_all = _explicit("all_to_all")
all_to_all_single = _explicit("all_to_all_single")
barrier = _explicit("barrier")
send = _explicit("send")
isend = _explicit("isend")
recv = _explicit("recv")
irecv = _explicit("irecv")
batch_isend_irecv = _explicit("batch_isend_irecv")

__all__ = ["COLLECTIVES", "P2POp", *COLLECTIVES]
