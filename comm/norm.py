"""Gradient-norm reduction for sharded models, on whatever device the gradients live.

The total norm of gradients sharded by FSDP, tensor or expert parallelism is a sum
(or max, or min) of per-shard contributions, reduced over exactly the groups the
gradients are sharded over: never over replicated mesh dimensions (that would
count those gradients once per replica), and only after ``Partial`` gradients are
summed. Every reduction goes through ``comm``'s collectives, so gradients
offloaded to the CPU reduce on an nccl or hccl group (the second seed).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, TypeGuard, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

# Private: torch's own test of whether a device runs the foreach kernels, which its
# clip_grad_norm_ asks; comm asks the same so that its choice matches torch's.
from torch.utils._foreach_utils import _device_has_foreach_support

from comm.collectives import all_reduce, all_reduce_coalesced

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_norm"]

TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]

_PARTIAL_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


def total_norm(tensors: TensorOrTensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: Optional[bool] = None, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The ``norm_type`` norm of all ``tensors`` together, across the ranks that shard them.

    Plain tensors are local shards of tensors sharded over ``group`` (``None``: not
    sharded, so not reduced); DTensors carry their own meshes and placements. The
    result is the same on every rank, on the first tensor's device and in its dtype,
    as :func:`torch.nn.utils.get_total_norm` returns it for unsharded tensors.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(tensor).__name__}")
    return _total_norm([(t, t) for t in tensors], _norm_type(norm_type), error_if_nonfinite, foreach, group)


def clip_grad_norm_(parameters: TensorOrTensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None,
                    group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place so their total norm is at most ``max_norm``.

    As :func:`torch.nn.utils.clip_grad_norm_`, for sharded models: ``param.main_grad``
    is used when present, else ``param.grad``; the norm is reduced as in
    :func:`total_norm`; the gradients are scaled by ``max_norm / (total + 1e-6)``
    clamped to 1, DTensors on their local tensors. Returns the total norm before
    clipping, reduced, as a plain tensor (torch's returns a DTensor for DTensor
    gradients). These extensions are why the drop-in mode leaves torch's in place.
    """
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    max_norm = float(max_norm)
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm}")
    pairs = [(p, _grad_of(p)) for p in parameters]
    norm = _total_norm(pairs, _norm_type(norm_type), error_if_nonfinite, foreach, group)
    grads = [_local(grad) for _, grad in pairs if grad is not None]
    if grads:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        _scale_(grads, coefficient, foreach)
    return norm


def _norm_type(norm_type: Any) -> float:
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"norm_type must be a number (p > 0, 0, inf or -inf), got {norm_type!r}") from None
    if math.isnan(value) or value < 0 and value != -math.inf:
        raise ValueError(f"norm_type must be p > 0, 0, inf or -inf, got {norm_type!r}")
    return value


def _grad_of(parameter: torch.Tensor) -> Optional[torch.Tensor]:
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"parameters must be tensors, got {type(parameter).__name__}")
    grad = getattr(parameter, "main_grad", None)
    return grad if grad is not None else parameter.grad


def _is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    # No DTensor exists before torch.distributed.tensor is imported, and importing it here
    # would add about 1.4 s to every `import comm` (half of torch's own import time).
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # The attribute, not to_local(): no autograd node per call (benchmarks/clip_grad.py:
    # 4.8 ms with to_local() against 2.2 ms for 200 parameters).
    return tensor._local_tensor if _is_dtensor(tensor) else tensor


_Bucket = Tuple[Tuple[dist.ProcessGroup, ...], List[Optional[torch.Tensor]]]


def _total_norm(pairs: List[Tuple[torch.Tensor, Optional[torch.Tensor]]], p: float, error_if_nonfinite: bool,
                foreach: Optional[bool], group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``pairs`` are (what says how it is sharded, the tensor to measure or None)."""
    present = [t for _, t in pairs if t is not None]
    if not pairs:
        return torch.tensor(0.0)
    result_device = _local(present[0]).device if present else torch.device("cpu")
    result_dtype = _local(present[0]).dtype if present else torch.get_default_dtype()
    measured = _reduce_partials(present)
    buckets = _buckets(pairs, measured, group)
    accumulate_dtype = torch.promote_types(result_dtype, torch.float32)
    contributions = [
        _reduced_contribution(groups, locals_, p, foreach, result_device, accumulate_dtype)
        for groups, locals_ in buckets.values()
    ]
    norm = _combine(contributions, p, result_device, accumulate_dtype).to(result_dtype)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return norm


def _reduce_partials(tensors: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """Local values of the tensors to measure, with ``Partial`` DTensors reduced first.

    Partial gradients are summed (or averaged) into copies, coalesced into one
    flat buffer per mesh dimension and op; the gradients themselves are left as
    they are (scaling a Partial gradient's pieces scales its sum alike).
    """
    measured = {id(t): _local(t) for t in tensors}
    pending: Dict[Tuple[Any, int, str], List[torch.Tensor]] = {}
    for tensor in tensors:
        if not _is_dtensor(tensor):
            continue
        for dim, placement in enumerate(tensor.placements):
            if placement.is_partial():
                op = str(getattr(placement, "reduce_op", "sum"))  # Partial's op; older torch: sum only
                pending.setdefault((tensor.device_mesh, dim, op), []).append(tensor)
    copies: Dict[int, torch.Tensor] = {}
    for (mesh, dim, op), members in pending.items():
        if op not in _PARTIAL_OPS:
            raise ValueError(f"cannot reduce a Partial({op!r}) gradient; expected sum, avg, max or min")
        buffers = [copies.setdefault(id(t), measured[id(t)].clone()) for t in members]
        all_reduce_coalesced(buffers, _PARTIAL_OPS[op], group=mesh.get_group(dim))
    measured.update(copies)
    return measured


def _buckets(pairs: List[Tuple[torch.Tensor, Optional[torch.Tensor]]], measured: Dict[int, torch.Tensor],
             group: Optional[dist.ProcessGroup]) -> Dict[Tuple[Tuple[int, ...], ...], _Bucket]:
    """Group tensors by the groups their norm is reduced over, in first-seen order.

    The key is the ranks of those groups, so every rank that shares them issues the
    same collectives in the same order, also for a bucket whose parameters have no
    gradient on this rank (None entries: they contribute nothing but still join).
    """
    buckets: Dict[Tuple[Tuple[int, ...], ...], _Bucket] = {}
    for owner, tensor in pairs:
        groups = _reduction_groups(tensor if tensor is not None else owner, group)
        key = tuple(tuple(dist.get_process_group_ranks(g)) for g in groups)
        bucket = buckets.setdefault(key, (groups, []))
        bucket[1].append(None if tensor is None else measured[id(tensor)])
    return buckets


def _reduction_groups(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Tuple[dist.ProcessGroup, ...]:
    """The groups over which ``tensor``'s shards add up: its mesh dims placed Shard."""
    if _is_dtensor(tensor):
        mesh = tensor.device_mesh
        return tuple(mesh.get_group(dim) for dim, placement in enumerate(tensor.placements) if placement.is_shard())
    if group is None:
        return ()
    return (group,)


def _reduced_contribution(groups: Tuple[dist.ProcessGroup, ...], entries: List[Optional[torch.Tensor]], p: float,
                          foreach: Optional[bool], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """This bucket's sum of |x|^p (or max, min, count) over all ranks sharing it."""
    value = _local_contribution(entries, p, foreach, device, dtype)
    op = ReduceOp.MAX if p == math.inf else ReduceOp.MIN if p == -math.inf else ReduceOp.SUM
    for group in groups:
        all_reduce(value, op, group)  # a small tensor wherever the gradients are: comm stages it
    if p == 0:
        # torch's 0-"norm" of many tensors counts the tensors holding a non-zero.
        return (value > 0).sum().to(dtype)
    return value


def _local_contribution(entries: List[Optional[torch.Tensor]], p: float, foreach: Optional[bool],
                        device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of a bucket: one 0-dim value, or for p = 0 a count per entry.

    Norms are taken foreach per device and dtype, folded on that device, and only
    the folded result moves to ``device``.
    """
    # Empty local shards (uneven sharding) contribute nothing, as absent gradients.
    present: List[Optional[torch.Tensor]] = [None if t is None or t.numel() == 0 else t for t in entries]
    counts = [torch.zeros((), dtype=dtype, device=device)] * len(entries)
    parts = []
    for (entry_device, _), members in _by_device_and_dtype(present).items():
        norms = torch.stack(_norms([t for _, t in members], p, foreach, entry_device)).to(dtype)
        if p == 0:
            for (index, _), count in zip(members, norms.to(device).unbind()):
                counts[index] = count
        else:
            parts.append(_fold(norms, p).to(device))
    if p == 0:
        return torch.stack(counts)
    if not parts:
        return torch.tensor(_identity(p), dtype=dtype, device=device)
    return _fold_powers(torch.stack(parts), p)


def _norms(tensors: List[torch.Tensor], p: float, foreach: Optional[bool], device: torch.device) -> List[torch.Tensor]:
    if foreach is not False and _device_has_foreach_support(device):
        return list(torch._foreach_norm(tensors, p))
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return [torch.linalg.vector_norm(t, p) for t in tensors]


def _fold(norms: torch.Tensor, p: float) -> torch.Tensor:
    """Turn per-tensor norms (p != 0) into the quantity that adds up across shards."""
    finite_p = p not in (math.inf, -math.inf)
    return _fold_powers(norms.pow(p) if finite_p else norms, p)


def _fold_powers(values: torch.Tensor, p: float) -> torch.Tensor:
    """Combine contributions: sums of powers and counts add; max and min fold."""
    if p == math.inf:
        return values.max()
    if p == -math.inf:
        return values.min()
    return values.sum()


def _identity(p: float) -> float:
    return math.inf if p == -math.inf else 0.0


def _combine(contributions: List[torch.Tensor], p: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if not contributions:
        return torch.tensor(_identity(p), dtype=dtype, device=device)
    total = _fold_powers(torch.stack([c.to(device) for c in contributions]), p)
    if p in (0.0, 1.0, math.inf, -math.inf):
        return total
    return total.pow(1.0 / p)


_Members = List[Tuple[int, torch.Tensor]]


def _by_device_and_dtype(tensors: Sequence[Optional[torch.Tensor]]) -> Dict[Tuple[torch.device, torch.dtype], _Members]:
    """(index, tensor) of the present tensors, grouped by device and dtype in first-seen order."""
    groups: Dict[Tuple[torch.device, torch.dtype], _Members] = {}
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            groups.setdefault((tensor.device, tensor.dtype), []).append((index, tensor))
    return groups


def _scale_(grads: List[torch.Tensor], coefficient: torch.Tensor, foreach: Optional[bool]) -> None:
    """Multiply ``grads`` in place by ``coefficient``, foreach per device and dtype."""
    with torch.no_grad():
        for (device, _), members in _by_device_and_dtype(grads).items():
            group = [grad for _, grad in members]
            factor = coefficient.to(device)
            if foreach is not False and _device_has_foreach_support(device):
                torch._foreach_mul_(group, factor)
            elif foreach:
                raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
            else:
                for grad in group:
                    grad.mul_(factor)
