"""torch.compile: what dynamo traces when compiled code calls comm's collectives.

Dynamo cannot trace comm's eager wrappers: their fast path reads a weak-reference
memo and the group's private attributes, which dynamo refuses (in torch 2.13 a
``ProcessGroup`` is an opaque object that exposes only its rank, size and name).
So comm gives dynamo, and only dynamo, a traceable twin of each wrapper
(``torch.compiler.substitute_in_graph``): eager calls never see the twins and pay
nothing for them.

A twin decides at trace time, from the group's name and the tensors' devices and
dtypes (all of which dynamo guards), what the eager call would do:

* served tensors: the in-place functional collective that dynamo puts in place of
  torch's own call, so the graph is torch's (fullgraph where torch's is, no
  recompilation per call);
* tensors the group does not serve (or ``ReduceOp.AVG`` the backend lacks): the
  copies onto the staging device, that collective and the write-back, all in the
  graph;
* anything else (``async_op=True``, collectives torch itself does not trace, bad
  arguments, gradient norms): one graph break, at which comm's eager wrapper runs,
  so the result and any error are the eager call's.

dynamo costs about 0.8 s to import, so comm does not import it: the twins are
registered when something else (``torch.compile``) imports ``torch._dynamo``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed import _functional_collectives as _functional

from comm import norm, patch
from comm.backend import _group_info, _GroupInfo, _native_avg
from comm.observability import log_first_staging
from comm.staging import AVG_AS_SUM, _staging_target

__all__: List[str] = []

_SUM = ReduceOp.SUM
# What the twins read, as globals of their own: reaching an object through
# torch's modules as well would add a guard, evaluated in Python on every call,
# that both paths still lead to it.
_Tensor, _ProcessGroup, _P2POp = torch.Tensor, dist.ProcessGroup, dist.P2POp
# The kind of each reducing twin's collective, for the backends' ReduceOp.AVG table.
_AVG_KIND = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter"}


class _Route(NamedTuple):
    """What a twin does, decided at trace time."""

    size: int  # the group's size
    target: Optional[str]  # the device to stage onto; None when nothing moves
    staged: Tuple[bool, ...]  # per tensor: whether it goes through a buffer on ``target``
    divisor: int  # what to divide the result by: the group size for emulated AVG, else 1
    reduce: str  # the reduce op as the functional collectives name it ("sum" for emulated AVG)


def _route(kind: str, group_name: Optional[str], device_types: Tuple[str, ...], dtype: torch.dtype, op: Any = None,
           peers: Tuple[Any, ...] = ()) -> Optional[_Route]:
    """How to run ``kind`` on tensors of these device types, or None for comm's eager wrapper (a graph break).

    Runs at trace time, on constants, with what comm's eager path knows of the
    group (``group_name`` None: the default group). torch's traced collective
    guards the group (the default one by identity, others by name) and dynamo the
    tensors' devices and dtypes.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]

    try:
        pg = dist.group.WORLD if group_name is None else _resolve_process_group(cast(Any, group_name))
        if pg is None:
            return None  # no default group: the eager call says so
        info = _group_info(pg)
        staged = tuple(kind_ not in info.device_types for kind_ in device_types)
        target = _staging_target(pg, info) if any(staged) else None
    except (RuntimeError, ValueError):
        return None  # the eager call says what is wrong
    if peers:
        return _Route(info.size, None, staged, 1, "") if target is None and _traced_peers(info, peers) else None
    reduce = _functional.REDUCE_OP_TO_STR.get(op) if kind in _AVG_KIND else ""
    if reduce is None:
        return None  # PREMUL_SUM and the like, which torch's compile refuses too
    divisor = 1
    if reduce == "avg" and not _native_avg(pg, target.type if target else device_types[0], _AVG_KIND[kind]):
        if not (dtype.is_floating_point or dtype.is_complex):
            return None  # the eager call raises torch's error for integer AVG
        divisor, reduce = info.size, "sum"
    if target is not None or divisor != 1:
        _log_staging(kind, pg, info.device_types, target)
    return _Route(info.size, None if target is None else str(target), staged, divisor, reduce)


def _traced_peers(info: _GroupInfo, peers: Tuple[Any, ...]) -> bool:
    """Whether torch traces sends to or receives from ``peers``: P2P compilation on, other ranks of the group.

    A staged point-to-point call runs eagerly: its write-back follows the caller's
    ``wait()``, outside the graph.
    """
    from torch._dynamo import config

    return bool(config.enable_p2p_compilation) and all(
        type(peer) is int and info.group_ranks.get(peer, info.rank) != info.rank for peer in peers
    )


def _log_staging(kind: str, pg: dist.ProcessGroup, served: FrozenSet[str], target: Optional[torch.device]) -> None:
    """comm's staging log line, once per (collective, group, reason), when a graph that stages is traced."""
    if target is None:
        message = f"{kind} (compiled): {AVG_AS_SUM}"
    else:
        message = f"{kind} (compiled): staging through {target} because the group serves only {sorted(served)}"
    log_first_staging(kind, id(pg), "compiled", lambda: message)


def _plan(kind: str, group: Any, tensors: Sequence[torch.Tensor], op: Any = None,
          peers: Tuple[Any, ...] = ()) -> Optional[_Route]:
    """The route for these tensors on ``group`` (None: the default group), or None for the eager wrapper."""
    if group is not None and not isinstance(group, _ProcessGroup):
        return None
    name = None if group is None else group.group_name
    return _route(kind, name, tuple(t.device.type for t in tensors), tensors[0].dtype, op, peers)


def _read(tensor: torch.Tensor, route: _Route, index: int) -> torch.Tensor:
    """What the collective reads: the tensor itself, or a copy on the staging device."""
    return tensor.to(route.target) if route.staged[index] else tensor


def _written(tensor: torch.Tensor, route: _Route, index: int) -> torch.Tensor:
    """Where the collective writes: the tensor itself, or a buffer on the staging device."""
    return torch.empty_like(tensor, device=route.target) if route.staged[index] else tensor


def _write_back(buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], route: _Route) -> None:
    """Divide (emulated AVG), then copy each buffer that is not its tensor back into it."""
    if route.target is None and route.divisor == 1:
        return  # torch's own call: nothing to do after it
    with torch.no_grad():
        for buffer, tensor in zip(buffers, tensors):
            if route.divisor != 1:
                buffer.div_(route.divisor)
            if buffer is not tensor:
                tensor.copy_(buffer)


# The twins: what dynamo traces in place of comm's wrapper of the same name, with
# its signature; each returns what torch's traced call returns.


def all_reduce(tensor: torch.Tensor, op: Any = _SUM, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Any:
    route = None if async_op else _plan("all_reduce", group, [tensor], op)
    if route is None:
        return _EAGER["all_reduce"](tensor, op, group, async_op)
    buffer = _read(tensor, route, 0)
    _FUNCTIONAL["all_reduce"](buffer, route.reduce, group)
    _write_back([buffer], [tensor], route)
    return None


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Any:
    route = None
    if not async_op and isinstance(tensor_list, list) and tensor_list:
        route = _plan("all_gather", group, [tensor, *tensor_list])
    if route is None or not _pieces_like(tensor_list, tensor, route.size):
        return _EAGER["all_gather"](tensor_list, tensor, group, async_op)
    buffers = [_written(out, route, i + 1) for i, out in enumerate(tensor_list)]
    _FUNCTIONAL["all_gather"](buffers, _read(tensor, route, 0), group)
    _write_back(buffers, tensor_list, route)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    route = None if async_op else _plan("all_gather_into_tensor", group, [output_tensor, input_tensor])
    if route is None or not _fits(output_tensor, input_tensor, input_tensor.numel() * route.size):
        return _EAGER["all_gather_into_tensor"](output_tensor, input_tensor, group, async_op)
    buffer = _written(output_tensor, route, 0)
    _FUNCTIONAL["all_gather_into_tensor"](buffer, _read(input_tensor, route, 1), group)
    _write_back([buffer], [output_tensor], route)
    return None


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = _SUM,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    route = None if async_op else _plan("reduce_scatter_tensor", group, [output, input], op)
    if route is None or not _fits(input, output, output.numel() * route.size):
        return _EAGER["reduce_scatter_tensor"](output, input, op, group, async_op)
    buffer = _written(output, route, 0)
    _FUNCTIONAL["reduce_scatter_tensor"](buffer, _read(input, route, 1), route.reduce, group)
    _write_back([buffer], [output], route)
    return None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> Any:
    route = None
    if not async_op and output_split_sizes is None and input_split_sizes is None:
        route = _plan("all_to_all_single", group, [output, input])
    if route is None or not _fits(output, input, input.numel()):
        return _EAGER["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, async_op)
    buffer = _written(output, route, 0)
    _FUNCTIONAL["all_to_all_single"](buffer, _read(input, route, 1), None, None, group)
    _write_back([buffer], [output], route)
    return None


def isend(tensor: torch.Tensor, dst: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, tag: int = 0,
          group_dst: Optional[int] = None) -> Any:
    return _point_to_point("isend", tensor, dst, group, tag, group_dst)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, tag: int = 0,
          group_src: Optional[int] = None) -> Any:
    return _point_to_point("irecv", tensor, src, group, tag, group_src)


def _point_to_point(name: str, tensor: torch.Tensor, peer: Optional[int], group: Optional[dist.ProcessGroup], tag: int,
                    group_peer: Optional[int]) -> Any:
    route = _plan(name, group, [tensor], peers=(peer,)) if group_peer is None else None
    if route is None:
        return _EAGER[name](tensor, peer, group, tag, group_peer)
    return _FUNCTIONAL[name](tensor, cast(int, peer), tag, group)


def batch_isend_irecv(p2p_op_list: List[dist.P2POp]) -> Any:
    route = None
    if isinstance(p2p_op_list, list) and p2p_op_list and all(
            isinstance(op, _P2POp) and op.group is p2p_op_list[0].group for op in p2p_op_list):
        # P2POp accepts only isend and irecv (torch's, comm's or a stand-in): the name says which.
        directions = [getattr(op.op, "__name__", "") for op in p2p_op_list]
        if all(direction in ("isend", "irecv") for direction in directions):
            route = _plan("batch_isend_irecv", p2p_op_list[0].group, [op.tensor for op in p2p_op_list],
                          peers=tuple(op.peer for op in p2p_op_list))
    if route is None:
        return _EAGER["batch_isend_irecv"](p2p_op_list)
    return _FUNCTIONAL["batch_isend_irecv"](directions, [op.peer for op in p2p_op_list],
                                            [op.tag for op in p2p_op_list], [op.tensor for op in p2p_op_list],
                                            p2p_op_list[0].group)


def _pieces_like(tensor_list: Any, tensor: torch.Tensor, size: int) -> bool:
    """One tensor per rank, each of ``tensor``'s shape and dtype (comm gathers other lists eagerly)."""
    shape, dtype = tensor.shape, tensor.dtype
    return isinstance(tensor_list, list) and len(tensor_list) == size and all(
        isinstance(out, _Tensor) and out.shape == shape and out.dtype == dtype for out in tensor_list
    )


def _fits(tensor: Any, other: Any, numel: int) -> bool:
    """Two tensors of one dtype, ``tensor`` holding ``numel`` elements (else the eager call says what is wrong)."""
    return (isinstance(tensor, _Tensor) and isinstance(other, _Tensor) and tensor.dtype == other.dtype
            and tensor.numel() == numel)


# The twins above, by the wrapper each stands in for.
_TRACED: Dict[str, Callable[..., Any]] = {
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "all_gather_into_tensor": all_gather_into_tensor,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "all_to_all_single": all_to_all_single,
    "isend": isend,
    "irecv": irecv,
    "batch_isend_irecv": batch_isend_irecv,
}
# Every wrapper, by name: what dynamo meets in user code, and what a graph break runs.
# An alias (all_gather_single is all_gather_into_tensor) is the same function: once.
_WRAPPERS: Dict[str, Callable[..., Any]] = {
    name: getattr(module, name)
    for module in (*patch.WRAPPER_MODULES, norm)
    for name in module.__all__
    if name != "P2POp" and getattr(module, name).__name__ == name
}
# comm's eager wrappers, as dynamo must call them: at a graph break (filled in at registration).
_EAGER: Dict[str, Callable[..., Any]] = {}
# The in-place functional collectives that dynamo puts in place of torch's calls, by
# the wrapper each twin calls instead (filled in at registration: older torch lacks some).
_FUNCTIONAL: Dict[str, Callable[..., Any]] = {}


def _register() -> None:
    """Tell dynamo what to trace in place of each wrapper, and never to compile a wrapper's own frame."""
    from torch._dynamo import substitute_in_graph
    from torch._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]
    from torch._dynamo.types import FrameAction, FrameExecStrategy  # type: ignore[attr-defined]

    _FUNCTIONAL.update(all_reduce=_functional.all_reduce_inplace, all_gather=_functional.all_gather_inplace,
                       all_gather_into_tensor=_functional.all_gather_tensor_inplace,
                       reduce_scatter_tensor=_functional.reduce_scatter_tensor_inplace,
                       all_to_all_single=_functional.all_to_all_inplace, isend=_functional.isend_inplace,
                       irecv=_functional.irecv_inplace, batch_isend_irecv=_functional.batch_p2p_ops_inplace)
    substitute_in_graph(_route, can_constant_fold_through=True)(_route)
    for name, wrapper in _WRAPPERS.items():
        # Run at a graph break, a wrapper and all it calls run eagerly: dynamo would
        # otherwise compile their frames, and fail on the group as it does inlining them.
        set_code_exec_strategy(wrapper.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        _EAGER[name] = torch.compiler.disable(wrapper)  # type: ignore[no-untyped-call]
        substitute_in_graph(wrapper, skip_signature_check=name not in _TRACED)(_TRACED.get(name) or _breaking(name))
    # A graph break at a call to comm.patch()'s stand-in runs the stand-in: it only
    # forwards, so dynamo need not compile its frame (one code object for every
    # stand-in: compiling it would recompile per stand-in).
    set_code_exec_strategy(patch._stand_in(_register, _register).__code__,
                           FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))


def _breaking(name: str) -> Callable[..., Any]:
    """A twin that runs comm's eager wrapper behind one graph break (torch traces none of these)."""

    def twin(*args: Any, **kwargs: Any) -> Any:
        return _EAGER[name](*args, **kwargs)

    return twin


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` right after ``torch._dynamo`` is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None:
            return spec
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            del loader.exec_module  # back to the class's
            execute(module)
            _register_or_warn()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _register_or_warn() -> None:
    try:
        _register()
    except Exception as error:  # noqa: BLE001 - a torch whose dynamo changed must still compile
        warnings.warn(f"comm could not register its collectives with torch.compile ({error!r}); compiled code "
                      "that calls them may fail", stacklevel=2)


def install() -> None:
    """Register the twins now if dynamo is loaded, else as soon as it is."""
    if not hasattr(torch.compiler, "substitute_in_graph"):
        return  # an older torch: its dynamo inlines the eager wrappers
    if "torch._dynamo" in sys.modules:
        _register_or_warn()
    elif not any(isinstance(finder, _WhenDynamoLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenDynamoLoads())
