"""The collectives that hand distinct pieces between ranks: gather, scatter and all-to-all.

Same shape as :mod:`comm.collectives`: the fast path when torch can take the
tensors as they are, else checks, the group, and staging, with torch's
signatures and return values.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from comm.arguments import check_root, check_tensor, check_tensor_list
from comm.backend import _GroupInfo
from comm.fastpath import fast_group, fast_list, known_group, namespace, served, slow_path
from comm.observability import call_counter
from comm.staging import Staging

__all__ = ["all_to_all", "all_to_all_single", "gather", "scatter"]

# torch's own functions, captured at import so that comm.patch() cannot make the
# wrappers call themselves.
_TORCH = namespace("comm.exchange._TORCH", {name: getattr(dist, name) for name in __all__})
_COUNT = namespace("comm.exchange._COUNT", {name: call_counter(name) for name in __all__})

Work = Any  # torch's work object, or comm's DeferredWork


def gather(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: Optional[int] = None,
           group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst`` (global rank 0 by default), as torch does."""
    if _fast_rooted(group, tensor, gather_list, dst, group_dst):
        _COUNT.gather()
        return _TORCH.gather(tensor, gather_list, dst, group, async_op)
    return slow_path("gather", group, _rooted_list, "gather", tensor, gather_list, dst, group_dst, async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None, src: Optional[int] = None,
            group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
            group_src: Optional[int] = None) -> Optional[Work]:
    """Scatter ``scatter_list`` from ``src`` (global rank 0 by default) into every rank's ``tensor``, as torch does."""
    if _fast_rooted(group, tensor, scatter_list, src, group_src):
        _COUNT.scatter()
        return _TORCH.scatter(tensor, scatter_list, src, group, async_op)
    return slow_path("scatter", group, _rooted_list, "scatter", tensor, scatter_list, src, group_src, async_op)


def _fast_rooted(group: Optional[dist.ProcessGroup], tensor: Any, pieces: Any, root_rank: Any,
                 group_root: Any) -> bool:
    """The fast path of gather and scatter: served tensors, one piece per rank on the root, none elsewhere."""
    info = fast_group(group, tensor)
    if info is None or group_root is not None:
        return False
    if root_rank is None:
        root_rank = 0
    root = info.group_ranks.get(root_rank) if type(root_rank) is int else None  # None: the slow path says why
    if root is None:
        return False
    return fast_list(info, pieces, tensor.numel(), tensor.dtype) if root == info.rank else not pieces


def _rooted_list(pg: dist.ProcessGroup, info: _GroupInfo, name: str, tensor: torch.Tensor,
                 pieces: Optional[List[torch.Tensor]], root_rank: Optional[int], group_root: Optional[int],
                 async_op: bool) -> Optional[Work]:
    """gather (every rank sends ``tensor``, the root receives ``pieces``) or scatter (the reverse)."""
    torch_call = _TORCH.gather if name == "gather" else _TORCH.scatter
    check_tensor(tensor, "tensor")
    label = "dst" if name == "gather" else "src"
    root, root_global = check_root(info, 0 if root_rank is None and group_root is None else root_rank, group_root,
                                   label)
    listed = _root_list(pieces, f"{name}_list", info, root, tensor)
    if served(info, [tensor, *listed]):
        return torch_call(tensor, listed or None, root_global, pg, async_op)
    with Staging(name, pg, info) as staging:
        if name == "gather":
            single, many = staging.send(tensor), staging.receive_all(listed) if listed else None
        else:
            many, single = staging.send_all(listed) if listed else None, staging.receive(tensor)
        staging.issue(torch_call(single, many, root_global, pg, True))
        return staging.finish(async_op, listed if name == "gather" and listed else [tensor])


def all_to_all(output_tensor_list: List[torch.Tensor], input_tensor_list: List[torch.Tensor],
               group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Send ``input_tensor_list[i]`` to rank ``i`` and receive rank ``i``'s into ``output_tensor_list[i]``."""
    info = known_group(group)
    first = input_tensor_list[0] if type(input_tensor_list) is list and input_tensor_list else None
    if info is not None and type(first) is torch.Tensor and fast_list(info, input_tensor_list, dtype=first.dtype) \
            and fast_list(info, output_tensor_list, dtype=first.dtype):
        _COUNT.all_to_all()
        return _TORCH.all_to_all(output_tensor_list, input_tensor_list, group, async_op)
    return slow_path("all_to_all", group, _all_to_all, output_tensor_list, input_tensor_list, async_op)


def _all_to_all(pg: dist.ProcessGroup, info: _GroupInfo, output_tensor_list: List[torch.Tensor],
                input_tensor_list: List[torch.Tensor], async_op: bool) -> Optional[Work]:
    inputs = check_tensor_list(input_tensor_list, "input_tensor_list", info.size)
    check_tensor_list(inputs, "input_tensor_list", dtype=inputs[0].dtype)
    outputs = check_tensor_list(output_tensor_list, "output_tensor_list", info.size, inputs[0].dtype)
    if served(info, [*outputs, *inputs]):
        return _TORCH.all_to_all(outputs, inputs, pg, async_op)
    with Staging("all_to_all", pg, info) as staging:
        sources = staging.send_all(inputs)
        staging.issue(_TORCH.all_to_all(staging.receive_all(outputs), sources, pg, True))
        return staging.finish(async_op, outputs)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> Optional[Work]:
    """Split ``input`` (dim 0) among the ranks and gather their pieces into ``output``, as torch does."""
    # Split sizes are checked on the slow path (a few us): only even splits ([] or None, as torch reads them) skip it.
    if (not output_split_sizes and not input_split_sizes
            and fast_group(group, output, input) is not None and output.dtype == input.dtype):
        _COUNT.all_to_all_single()
        return _TORCH.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op)
    return slow_path("all_to_all_single", group, _all_to_all_single, output, input, output_split_sizes,
                     input_split_sizes, async_op)


def _all_to_all_single(pg: dist.ProcessGroup, info: _GroupInfo, output: torch.Tensor, input: torch.Tensor,
                       output_split_sizes: Optional[List[int]], input_split_sizes: Optional[List[int]],
                       async_op: bool) -> Optional[Work]:
    check_tensor(output, "output")
    check_tensor(input, "input")
    if output.dtype != input.dtype:
        raise ValueError(f"output has dtype {output.dtype}; expected {input.dtype} like input")
    _check_splits(output_split_sizes, "output_split_sizes", output, info.size)
    _check_splits(input_split_sizes, "input_split_sizes", input, info.size)
    if served(info, [output, input]):
        return _TORCH.all_to_all_single(output, input, output_split_sizes, input_split_sizes, pg, async_op)
    with Staging("all_to_all_single", pg, info) as staging:
        source = staging.send(input)
        staging.issue(_TORCH.all_to_all_single(staging.receive(output), source, output_split_sizes,
                                               input_split_sizes, pg, True))
        return staging.finish(async_op, [output])


def _root_list(tensors: Optional[List[torch.Tensor]], name: str, info: _GroupInfo, root: int,
               like: torch.Tensor) -> List[torch.Tensor]:
    """The root's list (one tensor per rank, sized like ``like``); others must pass none."""
    if info.rank != root:
        if tensors:
            raise ValueError(f"{name} must be None or empty on ranks other than the root (group rank {root})")
        return []
    if not tensors:
        raise ValueError(f"{name} is required on the root (group rank {root}): one tensor per rank of the group")
    return check_tensor_list(tensors, name, info.size, like.dtype, like.numel())


def _check_splits(splits: Optional[List[int]], name: str, tensor: torch.Tensor, size: int) -> None:
    """Refuse split sizes that are not one non-negative int per rank adding up to ``tensor``'s first dimension."""
    if splits is None or isinstance(splits, (list, tuple)) and not splits:
        return  # even splits, as torch reads None and []
    if not isinstance(splits, (list, tuple)) or len(splits) != size or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in splits
    ):
        raise ValueError(f"{name} must be a list of {size} non-negative ints, one per rank; got {splits!r}")
    first = tensor.size(0) if tensor.dim() else 1
    if sum(splits) != first:
        raise ValueError(f"{name} adds up to {sum(splits)}; expected {first}, the tensor's first dimension")
