"""The collectives that reduce or replicate: torch.distributed's signatures, on any device.

Each call first asks :func:`comm.fastpath.fast_group` whether torch can take its
tensors as they are (the group was seen before and serves their devices): then
it calls torch directly, with no copy, allocation or synchronisation. Otherwise
it checks its arguments, resolves the group, and either calls torch (served) or
stages: a :class:`comm.staging.Staging` copies the inputs onto a device the
backend serves, the collective runs there, and the results are written back into
the caller's tensors. Each function below states its inputs (``send``), its
outputs (``receive``), its root and its reduce op; the staging module does the
rest. The collectives that hand distinct pieces between ranks (gather, scatter,
all-to-all) are in :mod:`comm.exchange`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from comm.arguments import check_root, check_sizes, check_tensor, check_tensor_list, device_type, given
from comm.backend import _GroupInfo
from comm.fastpath import fast_group, fast_list, known_group, namespace, served, slow_path
from comm.observability import call_counter
from comm.staging import Staging, emulates_avg

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
]

# The torch function each wrapper calls, captured at import so that comm.patch()
# cannot make the wrappers call themselves. For one flat buffer comm calls whichever
# name this torch does not deprecate: torch >= 2.12 deprecates the *_tensor names in
# favour of *_single.
_TORCH = namespace("comm.collectives._TORCH", dict(
    all_reduce=dist.all_reduce, broadcast=dist.broadcast, reduce=dist.reduce, all_gather=dist.all_gather,
    reduce_scatter=dist.reduce_scatter, barrier=dist.barrier,
    all_gather_into_tensor=getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
    reduce_scatter_tensor=getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
))
# One call counter per collective: counting is a single C call on the fast path.
_COUNT = namespace("comm.collectives._COUNT",
                   {name: call_counter(name) for name in __all__ if not name.endswith("_single")})

Work = Any  # torch's work object, or comm's DeferredWork
_SUM, _AVG = ReduceOp.SUM, ReduceOp.AVG


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    """Reduce ``tensor`` across the group in place, as :func:`torch.distributed.all_reduce`."""
    if (op is _SUM or op != _AVG) and fast_group(group, tensor) is not None:
        _COUNT.all_reduce()
        return _TORCH.all_reduce(tensor, op, group, async_op)
    return slow_path("all_reduce", group, _all_reduce, tensor, op, async_op)


def _all_reduce(pg: dist.ProcessGroup, info: _GroupInfo, tensor: torch.Tensor, op: Any,
                async_op: bool) -> Optional[Work]:
    check_tensor(tensor, "tensor")
    average = emulates_avg(op, pg, info, tensor, "all_reduce")
    if not average and device_type(tensor) in info.device_types:
        return _TORCH.all_reduce(tensor, op, pg, async_op)
    with Staging("all_reduce", pg, info, average) as staging:
        staging.issue(_TORCH.all_reduce(staging.receive(tensor, reads=True), staging.op(op), pg, True))
        return staging.finish(async_op, [tensor])


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Reduce every tensor in place with one collective per (device, dtype), not one per tensor."""
    return slow_path("all_reduce_coalesced", group, _all_reduce_coalesced, tensors, op, async_op)


def _all_reduce_coalesced(pg: dist.ProcessGroup, info: _GroupInfo, tensors: Sequence[torch.Tensor], op: Any,
                          async_op: bool) -> Optional[Work]:
    tensors = check_tensor_list(tensors, "tensors")
    if not tensors:
        return None
    average = any([emulates_avg(op, pg, info, t, "all_reduce") for t in tensors])  # every one checked: none sent
    buckets: Dict[Any, List[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with Staging("all_reduce_coalesced", pg, info, average) as staging:
        for members in buckets.values():
            staging.issue(_TORCH.all_reduce(staging.receive_joined(members), staging.op(op), pg, True))
        return staging.finish(async_op, tensors)


def broadcast(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
              async_op: bool = False, group_src: Optional[int] = None) -> Optional[Work]:
    """Broadcast ``tensor`` from ``src`` (a global rank) or ``group_src``, as torch does."""
    info = fast_group(group, tensor)
    if info is not None and group_src is None and type(src) is int and src in info.group_ranks:
        _COUNT.broadcast()
        return _TORCH.broadcast(tensor, src, group, async_op)
    return slow_path("broadcast", group, _rooted, tensor, src, group_src, None, async_op)


def reduce(tensor: torch.Tensor, dst: Optional[int] = None, op: Any = ReduceOp.SUM,
           group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Reduce ``tensor`` onto ``dst`` (a global rank) or ``group_dst``, as torch does.

    On the staging path only the destination's tensor is written; others are left
    as they were (torch leaves them unspecified).
    """
    info = fast_group(group, tensor)
    if info is not None and (op is _SUM or op != _AVG) and group_dst is None and type(dst) is int and (
            dst in info.group_ranks):
        _COUNT.reduce()
        return _TORCH.reduce(tensor, dst, op, group, async_op)
    return slow_path("reduce", group, _rooted, tensor, dst, group_dst, op, async_op)


def _rooted(pg: dist.ProcessGroup, info: _GroupInfo, tensor: torch.Tensor, root_rank: Optional[int],
            group_root: Optional[int], op: Any, async_op: bool) -> Optional[Work]:
    """broadcast (``op`` None: the root sends, the others receive) or reduce (all send, the root receives)."""
    check_tensor(tensor, "tensor")
    root, root_global = check_root(info, root_rank, group_root, "src" if op is None else "dst")
    average = op is not None and emulates_avg(op, pg, info, tensor, "reduce")
    if not average and served(info, [tensor]):
        return _broadcast_or_reduce(tensor, root_global, op, pg, async_op)
    with Staging("broadcast" if op is None else "reduce", pg, info, average) as staging:
        if op is None:  # the source already holds the data: only receivers copy back
            buffer = staging.send(tensor) if info.rank == root else staging.receive(tensor)
        else:
            buffer = staging.receive(tensor, reads=True) if info.rank == root else staging.send(tensor)
        staging.issue(_broadcast_or_reduce(buffer, root_global, op and staging.op(op), pg, True))
        return staging.finish(async_op, [tensor])


def _broadcast_or_reduce(tensor: torch.Tensor, root: int, op: Any, pg: dist.ProcessGroup, async_op: bool) -> Any:
    if op is None:
        return _TORCH.broadcast(tensor, root, pg, async_op)
    return _TORCH.reduce(tensor, root, op, pg, async_op)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list``, as torch does.

    Unequal sizes work on every backend (gloo rejects them): ``tensor_list[i]`` must
    have rank ``i``'s number of elements.
    """
    info = fast_group(group, tensor)
    if info is not None and fast_list(info, tensor_list, tensor.numel(), tensor.dtype):
        _COUNT.all_gather()
        return _TORCH.all_gather(tensor_list, tensor, group, async_op)
    return slow_path("all_gather", group, _all_gather, tensor_list, tensor, async_op)


def _all_gather(pg: dist.ProcessGroup, info: _GroupInfo, tensor_list: List[torch.Tensor], tensor: torch.Tensor,
                async_op: bool) -> Optional[Work]:
    check_tensor(tensor, "tensor")
    outputs = check_tensor_list(tensor_list, "tensor_list", length=info.size, dtype=tensor.dtype)
    if any(out.numel() != tensor.numel() for out in outputs):
        return _all_gather_uneven(outputs, tensor, pg, info, async_op)
    if served(info, [tensor, *outputs]):
        return _TORCH.all_gather(tensor_list, tensor, pg, async_op)
    with Staging("all_gather", pg, info) as staging:
        source = staging.send(tensor)
        gathered = staging.receive_flat(outputs, None, tensor.numel() * info.size, tensor.dtype, source.device)
        staging.issue(_gather_flat(gathered, source, pg, info))
        return staging.finish(async_op, outputs)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``input_tensor`` into ``output_tensor``, as torch does.

    Also comm's ``all_gather_single`` (torch >= 2.12's name for it); comm calls
    whichever of the two this torch does not deprecate, and counts both as this one.
    """
    info = fast_group(group, output_tensor, input_tensor)
    if info is not None and _fits(output_tensor, input_tensor, input_tensor.numel() * info.size):
        _COUNT.all_gather_into_tensor()
        return _TORCH.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
    return slow_path("all_gather_into_tensor", group, _flat, output_tensor, input_tensor, None, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Reduce ``input`` across ranks and scatter equal pieces into ``output``, as torch does.

    Also comm's ``reduce_scatter_single`` (torch >= 2.12's name for it), as for
    :func:`all_gather_into_tensor`.
    """
    info = fast_group(group, output, input)
    if info is not None and (op is _SUM or op != _AVG) and _fits(input, output, output.numel() * info.size):
        _COUNT.reduce_scatter_tensor()
        return _TORCH.reduce_scatter_tensor(output, input, op, group, async_op)
    return slow_path("reduce_scatter_tensor", group, _flat, output, input, op, async_op)


def _flat(pg: dist.ProcessGroup, info: _GroupInfo, output: torch.Tensor, input: torch.Tensor, op: Any,
          async_op: bool) -> Optional[Work]:
    """all_gather_into_tensor (``op`` None) or reduce_scatter_tensor: one flat input, one flat output."""
    gathering = op is None
    out_name, in_name = ("output_tensor", "input_tensor") if gathering else ("output", "input")
    check_tensor(output, out_name)
    check_tensor(input, in_name)
    if gathering:
        check_sizes(output, out_name, input.numel() * info.size, input.dtype)
    else:
        check_sizes(input, in_name, output.numel() * info.size, output.dtype)
    average = not gathering and emulates_avg(op, pg, info, input, "reduce_scatter")
    if not average and served(info, [input, output]):
        if gathering:
            return _TORCH.all_gather_into_tensor(output, input, pg, async_op)
        return _TORCH.reduce_scatter_tensor(output, input, op, pg, async_op)
    with Staging("all_gather_into_tensor" if gathering else "reduce_scatter_tensor", pg, info, average) as staging:
        source, target = staging.send(input), staging.receive(output)
        if gathering:
            staging.issue(_gather_flat(target, source, pg, info))
        else:
            staging.issue(_TORCH.reduce_scatter_tensor(target, source, staging.op(op), pg, True))
        return staging.finish(async_op, [output])


# torch >= 2.12's names for the two above (FSDP calls them); on older torch comm still offers them.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def reduce_scatter(output: torch.Tensor, input_list: List[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Reduce ``input_list[i]`` across ranks into rank ``i``'s ``output``, as torch does."""
    info = fast_group(group, output)
    if info is not None and (op is _SUM or op != _AVG) and fast_list(info, input_list, output.numel(), output.dtype):
        _COUNT.reduce_scatter()
        return _TORCH.reduce_scatter(output, input_list, op, group, async_op)
    return slow_path("reduce_scatter", group, _reduce_scatter, output, input_list, op, async_op)


def _reduce_scatter(pg: dist.ProcessGroup, info: _GroupInfo, output: torch.Tensor, input_list: List[torch.Tensor],
                    op: Any, async_op: bool) -> Optional[Work]:
    check_tensor(output, "output")
    inputs = check_tensor_list(input_list, "input_list", info.size, output.dtype, output.numel())
    average = emulates_avg(op, pg, info, output, "reduce_scatter")
    if not average and served(info, [output, *inputs]):
        return _TORCH.reduce_scatter(output, inputs, op, pg, async_op)
    with Staging("reduce_scatter", pg, info, average) as staging:
        sources = staging.send_all(inputs)
        staging.issue(_TORCH.reduce_scatter(staging.receive(output), sources, staging.op(op), pg, True))
        return staging.finish(async_op, [output])


def barrier(group: Optional[dist.ProcessGroup] = None, async_op: bool = False, device_ids: Optional[List[int]] = None,
            timeout: Optional[Any] = None) -> Optional[Work]:
    """Wait until every rank of the group reaches this call, as torch does.

    There is nothing to stage: torch runs the barrier on a device the group serves
    (its bound device, the current accelerator, or the CPU for a CPU group).
    """
    if timeout is None and known_group(group) is not None:
        _COUNT.barrier()
        return _TORCH.barrier(group, async_op, device_ids)
    return slow_path("barrier", group, _barrier, async_op, device_ids, timeout)


def _barrier(pg: dist.ProcessGroup, info: _GroupInfo, async_op: bool, device_ids: Optional[List[int]],
             timeout: Optional[Any]) -> Optional[Work]:
    return _TORCH.barrier(pg, async_op, device_ids, **given(timeout=timeout))


def _fits(tensor: torch.Tensor, other: torch.Tensor, numel: int) -> bool:
    """Whether ``tensor`` holds ``numel`` elements of ``other``'s dtype."""
    return tensor.numel() == numel and tensor.dtype == other.dtype


def _all_gather_uneven(outputs: List[torch.Tensor], tensor: torch.Tensor, pg: dist.ProcessGroup, info: _GroupInfo,
                       async_op: bool) -> Optional[Work]:
    """Gather sizes, pad to the largest, gather, trim: unequal sizes on any backend."""
    with Staging("all_gather", pg, info, reason="uneven") as staging:
        device = staging.where(tensor)
        sizes = _gather_sizes(tensor.numel(), device, pg, info)
        mismatched = [i for i, (out, n) in enumerate(zip(outputs, sizes)) if out.numel() != n]
        largest = max(sizes)
        padded = torch.zeros(largest, dtype=tensor.dtype, device=device)
        padded[: tensor.numel()] = staging.send(tensor).reshape(-1)
        starts = [i * largest for i in range(info.size)]
        gathered = staging.receive_flat(outputs, starts, largest * info.size, tensor.dtype, device)
        work = _gather_flat(gathered, padded, pg, info)
        if mismatched:  # every rank still joined the gather, so none is left hanging
            work.wait()
            raise ValueError(
                f"tensor_list[{mismatched[0]}] has {outputs[mismatched[0]].numel()} elements but rank "
                f"{mismatched[0]} sent {sizes[mismatched[0]]}; expected tensor_list[i] sized like rank i's tensor"
            )
        staging.issue(work)
        return staging.finish(async_op, outputs)


def _gather_sizes(numel: int, device: torch.device, pg: dist.ProcessGroup, info: _GroupInfo) -> List[int]:
    sizes = torch.empty(info.size, dtype=torch.int64, device=device)
    _gather_flat(sizes, torch.tensor([numel], dtype=torch.int64, device=device), pg, info).wait()
    return [int(n) for n in sizes.cpu()]


def _gather_flat(output: torch.Tensor, input: torch.Tensor, pg: dist.ProcessGroup, info: _GroupInfo) -> Any:
    """Start gathering every rank's ``input`` into ``output`` (one flat buffer), on any backend.

    gloo's flat all-gather, where it has one, is its list all-gather over chunks of
    the output; gloo in torch 2.1 has none ("no support for _allgather_base"), so
    comm does the same itself for gloo.
    """
    if info.backends.get(input.device.type) == "gloo":
        return _TORCH.all_gather(list(output.view(-1).chunk(info.size)), input.view(-1), pg, True)
    return _TORCH.all_gather_into_tensor(output, input, pg, True)

