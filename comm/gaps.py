"""What comm's explicit calls add where a backend falls short of torch's API.

* ``ReduceOp.AVG`` runs as SUM, then a divide of the results, where the backend of
  the tensors' device lacks it or gets it wrong (some HCCL parts, XCCL, gloo before
  torch 2.8, NCCL at world size 1). Integer tensors get torch's own error first,
  before anything is sent. Staged calls need none of this: comm's staging backend
  always runs AVG as SUM on its copies.
* ``all_gather`` with pieces of unequal sizes, which gloo rejects (before it sends
  anything): one flat all-gather of pieces padded to the largest, then each piece
  copied out. NCCL gathers them itself.

Each entry of :data:`GAPS` is a :class:`Gap`: ``call`` takes torch's function and a
call's arguments, and calls torch's function (looked up by the caller on every call,
so that comm.profile() can time it); ``needed_on`` says once per group whether its
calls can need the gap at all, and ``spared_by`` which argument value never needs
it, so that comm's explicit calls skip the per-call check where neither holds. A gap whose
``refused`` is set is filled, on the groups it is not needed on, only where torch's own
call refused the arguments: comm's explicit calls run torch's call as it is, and hand it
to the gap only where it raised the refusal ``refused`` recognises, before anything was
sent (no check while torch's call succeeds; any other error is torch's).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from comm._releases import flat_gather
from comm.groups import backend_config, backends_by_device, device_types_of, native_avg, resolve_group
from comm.work import DeferredWork

__all__ = ["AVERAGES_INTEGERS", "GAPS", "Gap"]


def _bound(call: Callable[..., Any], args: Any, kwargs: Any) -> inspect.BoundArguments:
    bound = inspect.signature(call).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _finished(work: Any, async_op: bool, finish: Callable[[], None], outputs: List[torch.Tensor]) -> Any:
    """Run ``finish`` once the collective is done: now, or when its work is waited on."""
    if not async_op:
        if work is not None:
            work.wait()
        finish()
        return None
    return DeferredWork([work], finish, outputs)


def _tensors(value: Any) -> List[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _asks_avg(args: Any, kwargs: Any) -> bool:
    ops = [arg for arg in args if isinstance(arg, (ReduceOp, ReduceOp.RedOpType))]
    if "op" in kwargs:
        ops.append(kwargs["op"])
    return any(op == ReduceOp.AVG for op in ops)


_FLAT_GATHER = flat_gather()
GapCall = Callable[[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]], Any]


class Gap(NamedTuple):
    """What comm adds to one of torch's calls where a backend falls short, and where it cannot be needed."""

    call: GapCall  # (torch's function, args, kwargs): the call, with the gap filled where this call needs it
    needed_on: Callable[[dist.ProcessGroup], bool]  # whether any call on this group may need it
    spared_by: Optional[Tuple[str, Any]] = None  # (parameter, value): a call passing this value never needs it
    # Given the error torch's call raised and the call's arguments by name, whether it is the backend's refusal
    # of what the gap fills, raised before anything was sent (gloo's of uneven all_gather pieces).
    refused: Optional[Callable[..., bool]] = None


def _gathers_uneven_unknown(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has a backend whose handling of uneven all_gather pieces comm does not know: any but gloo
    (which refuses them before sending anything: ProcessGroupGloo's allgather checks every size as it is called)
    and nccl (which gathers them itself: ProcessGroupNCCL's allgather falls back to broadcasts)."""
    return not set(backends_by_device(backend_config(group)).values()) <= {"gloo", "nccl"}


# Backends whose AVG of integers is an integer, the one place that says so: comm's staging backend reads it
# (comm/slot.py hands it over), and where a backend lacks AVG, comm's SUM-and-divide stands in for it with a
# floor division. NCCL's: torch's ProcessGroupNCCL.cpp maps AVG to ncclAvg for every dtype but bool, which it
# refuses with its own message. HCCL's, as Ascend's own tests expect (test/distributed test_allreduce.py,
# test_dist_all_reduce_avg and _uint8_avg: the sum floor-divided by the world size). Elsewhere (gloo divides in
# floating point) an integer AVG gets torch's error for the divide.
AVERAGES_INTEGERS = frozenset({"nccl", "hccl"})


def _integral(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def _average(kind: str, output: str) -> Gap:
    """A call with ``op=ReduceOp.AVG`` run as SUM and divide where the backend lacks AVG."""

    def lacks_avg(group: dist.ProcessGroup) -> bool:
        """Whether the backend of any device type ``group`` serves lacks AVG for ``kind`` (comm's staging backend
        never does: it runs AVG as SUM on its copies)."""
        try:
            types = device_types_of(group) | frozenset(backends_by_device(backend_config(group)))
        except RuntimeError:  # cannot tell what serves it: check every call
            return True
        return not all(native_avg(group, device_type, kind) for device_type in types)

    def call(torch_call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not _asks_avg(args, kwargs):
            return torch_call(*args, **kwargs)
        bound = _bound(torch_call, args, kwargs)
        outputs = _tensors(bound.arguments[output])
        group = resolve_group(bound.arguments.get("group"))
        device_type = outputs[0].device.type if outputs else ""
        if bound.arguments["op"] != ReduceOp.AVG or not outputs or native_avg(group, device_type, kind):
            return torch_call(*args, **kwargs)
        floor = backends_by_device(backend_config(group)).get(device_type) in AVERAGES_INTEGERS
        for tensor in outputs:
            if not (floor and _integral(tensor)):
                torch.empty(0, dtype=tensor.dtype).div_(2)  # torch's own error for integer and bool tensors
        bound.arguments["op"] = ReduceOp.SUM
        async_op = bound.arguments["async_op"]
        bound.arguments["async_op"] = True
        work = torch_call(*bound.args, **bound.kwargs)
        size = group.size()

        def divide() -> None:
            for tensor in outputs:
                if _integral(tensor):
                    tensor.div_(size, rounding_mode="floor")
                else:
                    tensor.div_(size)

        return _finished(work, async_op, divide, outputs)

    return Gap(call, lacks_avg, ("op", ReduceOp.SUM))


def _uneven_all_gather(torch_call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``all_gather``, also when the pieces differ in size: through one padded flat all-gather."""
    return _all_gather(torch_call, *args, **kwargs)


def _refused_uneven(error: Exception, tensor_list: Any, tensor: Any, **_others: Any) -> bool:
    """Whether ``error`` is gloo's refusal of uneven pieces ("ProcessGroupGloo::allgather: invalid tensor size at
    index 0 (expected (4), got (3))", raised as the call is made) for pieces that are uneven."""
    return "invalid tensor size" in str(error) and _uneven(tensor_list, tensor)


def _uneven(tensor_list: Any, tensor: Any) -> bool:
    """Whether ``all_gather``'s pieces differ in size from ``tensor`` (tensors all, else torch's call says why not)."""
    return isinstance(tensor_list, list) and isinstance(tensor, torch.Tensor) and all(
        isinstance(piece, torch.Tensor) for piece in tensor_list) and any(
        piece.numel() != tensor.numel() for piece in tensor_list)


def _all_gather(torch_call: Callable[..., Any], tensor_list: List[torch.Tensor], tensor: torch.Tensor,
                group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
    if not _uneven(tensor_list, tensor):
        return torch_call(tensor_list, tensor, group, async_op)  # torch's call, and torch's errors
    pg = resolve_group(group)
    if len(tensor_list) != pg.size():
        raise ValueError(f"tensor_list must have one tensor per rank ({pg.size()}), got {len(tensor_list)}")
    if any(piece.dtype != tensor.dtype for piece in tensor_list):
        raise TypeError(f"every tensor in tensor_list must have dtype {tensor.dtype}, as tensor has")
    if tensor.numel() != tensor_list[pg.rank()].numel():
        raise ValueError(f"tensor has {tensor.numel()} elements, but this rank's piece in tensor_list has "
                         f"{tensor_list[pg.rank()].numel()}")
    longest = max(piece.numel() for piece in tensor_list)
    padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.numel()] = tensor.reshape(-1)
    gathered = torch.empty(longest * pg.size(), dtype=tensor.dtype, device=tensor.device)
    work = _FLAT_GATHER(gathered, padded, group, async_op=True)

    def copy_out() -> None:
        for index, piece in enumerate(tensor_list):
            start = index * longest
            piece.copy_(gathered[start: start + piece.numel()].view(piece.shape))

    return _finished(work, async_op, copy_out, list(tensor_list))


GAPS: Dict[str, Gap] = {
    "all_reduce": _average("all_reduce", "tensor"),
    "reduce": _average("reduce", "tensor"),
    "reduce_scatter": _average("reduce_scatter", "output"),
    "reduce_scatter_tensor": _average("reduce_scatter", "output"),
    "reduce_scatter_single": _average("reduce_scatter", "output"),
    # The pieces' sizes are known per call only: on gloo and nccl groups filled where gloo refused them.
    "all_gather": Gap(_uneven_all_gather, _gathers_uneven_unknown, refused=_refused_uneven),
}
