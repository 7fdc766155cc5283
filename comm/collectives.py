"""The collectives: torch.distributed's signatures, on whatever device the tensors live.

Each call asks which device types the group serves (cached per group). When every
tensor is served and the backend can do the operation, it calls torch directly:
no copy, no allocation, no extra synchronisation. Otherwise it stages the tensors
onto a device the backend serves (one flat buffer per dtype), runs the collective
there and writes the results back into the caller's tensors. A collective that
fails on the staging path leaves the caller's tensors as they were.
"""

from __future__ import annotations

import time
import types
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import _world

from comm.backend import _group_info, _native_avg, _resolve_group
from comm.observability import call_counter, count_call, count_staging, log_first_staging
from comm.staging import DeferredWork, _staging_target, add_note, restore, stage

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "reduce_scatter_tensor",
]

# torch's own functions, captured at import so that comm.patch() cannot make the
# wrappers call themselves.
_TORCH = types.SimpleNamespace(
    all_reduce=dist.all_reduce,
    broadcast=dist.broadcast,
    all_gather=dist.all_gather,
    all_gather_into_tensor=dist.all_gather_into_tensor,
    reduce_scatter_tensor=dist.reduce_scatter_tensor,
    reduce=dist.reduce,
)
# What comm itself calls to gather into, and reduce-scatter from, one flat buffer:
# torch >= 2.12 deprecates the *_tensor names in favour of *_single.
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

Work = Any  # torch's work object, or comm's DeferredWork
_SUM, _AVG = ReduceOp.SUM, ReduceOp.AVG
_Tensor = torch.Tensor
_torch_all_reduce = _TORCH.all_reduce  # the fast path's one call, without the attribute lookup
_count_all_reduce = call_counter("all_reduce")


def _no_group() -> object:
    """Stands in for a weak reference to a group: it returns what no group argument is."""
    return _no_group


# What the previous all_reduce (on any thread) learnt about its group: a weak
# reference to the group, whether it serves CPU tensors, CUDA tensors, and which
# device types it serves. With it, the next all_reduce on the same group decides the
# fast path in its own frame: on two ranks sharing two cores, every 0.1 us spent
# before a small collective comes back as about 3 us of latency
# (benchmarks/overhead.py). Replaced whole, so a reader never sees half of it.
_last_all_reduce: Tuple[Callable[[], object], bool, bool, FrozenSet[str]] = (_no_group, False, False, frozenset())


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    """Reduce ``tensor`` across the group in place, as :func:`torch.distributed.all_reduce`."""
    group_ref, serves_cpu, serves_cuda, served = _last_all_reduce
    # torch keeps the default group in _world._default_pg (torch >= 2.0); reading it
    # directly skips the two property calls behind dist.GroupMember.WORLD.
    if (
        group_ref() is (_world._default_pg if group is None else group)
        and type(tensor) is _Tensor
        and (op is _SUM or op != _AVG)
        and (serves_cpu if tensor.is_cpu else serves_cuda if tensor.is_cuda else tensor.device.type in served)
    ):
        _count_all_reduce()
        return _torch_all_reduce(tensor, op, group, async_op)
    return _all_reduce_resolved(tensor, op, group, async_op)


def _all_reduce_resolved(tensor: torch.Tensor, op: Any, group: Optional[dist.ProcessGroup],
                         async_op: bool) -> Optional[Work]:
    """all_reduce when the fast path could not decide: validate, resolve, then run or stage."""
    global _last_all_reduce
    pg = _member_group(group)
    if pg is None:
        return _TORCH.all_reduce(tensor, op, group, async_op)
    device_type = _check_tensor(tensor, "tensor")
    _count_all_reduce()
    served = _group_info(pg).device_types
    if _last_all_reduce[0]() is not pg:
        _last_all_reduce = (weakref.ref(pg), "cpu" in served, "cuda" in served, served)
    emulate_avg = op is not _SUM and _emulates_avg(op, pg, tensor, "all_reduce")
    if not emulate_avg and device_type in served:
        return _TORCH.all_reduce(tensor, op, group, async_op)
    return _all_reduce_buckets("all_reduce", [tensor], op, pg, async_op, emulate_avg)


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Reduce every tensor in place with one collective per (device, dtype), not one per tensor."""
    pg = _member_group(group)
    tensors = _check_tensor_list(tensors, "tensors")
    if pg is None or not tensors:
        return None
    count_call("all_reduce_coalesced")
    emulate_avg = any(_emulates_avg(op, pg, t, "all_reduce") for t in tensors)
    return _all_reduce_buckets("all_reduce_coalesced", tensors, op, pg, async_op, emulate_avg)


def broadcast(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
              async_op: bool = False, group_src: Optional[int] = None) -> Optional[Work]:
    """Broadcast ``tensor`` from ``src`` (a global rank) or ``group_src``, as torch does."""
    pg = _member_group(group)
    if pg is None:
        return _TORCH.broadcast(tensor, src, group, async_op, **_given(group_src=group_src))
    _check_tensor(tensor, "tensor")
    root, root_global = _root(pg, src, group_src, "src")
    count_call("broadcast")
    if _served(pg, [tensor]):
        return _TORCH.broadcast(tensor, root_global, pg, async_op)
    is_root = pg.rank() == root
    target = _staging_target(pg, _group_info(pg).device_types)
    with _Staging("broadcast", pg, "device") as staging:
        if is_root:
            buffer = staging.stage_in([tensor], target)
        else:
            buffer = torch.empty(tensor.numel(), dtype=tensor.dtype, device=target)
        # The source already holds the data: only receivers copy back.
        finish = staging.finisher(buffer, [] if is_root else [tensor])
        work = _TORCH.broadcast(buffer, root_global, pg, True)
        return staging.complete([work], finish, [tensor], async_op)


def reduce(tensor: torch.Tensor, dst: Optional[int] = None, op: Any = ReduceOp.SUM,
           group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Reduce ``tensor`` onto ``dst`` (a global rank) or ``group_dst``, as torch does.

    On the staging path only the destination's tensor is written; others are left
    as they were (torch leaves them unspecified).
    """
    pg = _member_group(group)
    if pg is None:
        return _TORCH.reduce(tensor, dst, op, group, async_op, **_given(group_dst=group_dst))
    _check_tensor(tensor, "tensor")
    root, root_global = _root(pg, dst, group_dst, "dst")
    count_call("reduce")
    emulate_avg = _emulates_avg(op, pg, tensor, "reduce")
    served = _served(pg, [tensor])
    if not emulate_avg and served:
        return _TORCH.reduce(tensor, root_global, op, pg, async_op)
    is_root = pg.rank() == root
    reason = "avg" if served else "device"
    target = _comm_device(tensor, pg)
    with _Staging("reduce", pg, reason) as staging:
        buffer = staging.stage_in([tensor], target)
        finish = staging.finisher(buffer, [tensor] if is_root else [], pg.size() if emulate_avg and is_root else 1)
        work = _TORCH.reduce(buffer, root_global, ReduceOp.SUM if emulate_avg else op, pg, True)
        return staging.complete([work], finish, [tensor], async_op)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list``, as torch does.

    Unequal sizes work on every backend (gloo rejects them): ``tensor_list[i]`` must
    have rank ``i``'s number of elements.
    """
    pg = _member_group(group)
    if pg is None:
        return _TORCH.all_gather(tensor_list, tensor, group, async_op)
    _check_tensor(tensor, "tensor")
    outputs = _check_tensor_list(tensor_list, "tensor_list", length=pg.size(), dtype=tensor.dtype)
    count_call("all_gather")
    numel = tensor.numel()
    uneven = any(out.numel() != numel for out in outputs)
    if not uneven and _served(pg, [tensor, *outputs]):
        return _TORCH.all_gather(tensor_list, tensor, pg, async_op)
    if uneven:
        return _all_gather_uneven(outputs, tensor, pg, async_op)
    target = _comm_device(tensor, pg)
    with _Staging("all_gather", pg, "device") as staging:
        source = staging.stage_in([tensor], target)
        gathered = torch.empty(numel * pg.size(), dtype=tensor.dtype, device=target)
        finish = staging.finisher(gathered, outputs)
        work = _gather_flat(gathered, source, pg, async_op=True)
        return staging.complete([work], finish, outputs, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``input_tensor`` into ``output_tensor``, as torch does."""
    pg = _member_group(group)
    if pg is None:
        return _TORCH.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
    _check_tensor(output_tensor, "output_tensor")
    _check_tensor(input_tensor, "input_tensor")
    _check_sizes(output_tensor, "output_tensor", input_tensor.numel() * pg.size(), input_tensor.dtype)
    count_call("all_gather_into_tensor")
    if _served(pg, [input_tensor, output_tensor]):
        return _TORCH.all_gather_into_tensor(output_tensor, input_tensor, pg, async_op)
    target = _comm_device(input_tensor, pg)
    with _Staging("all_gather_into_tensor", pg, "device") as staging:
        source = staging.stage_in([input_tensor], target)
        gathered = torch.empty(output_tensor.numel(), dtype=output_tensor.dtype, device=target)
        finish = staging.finisher(gathered, [output_tensor])
        work = _gather_flat(gathered, source, pg, async_op=True)
        return staging.complete([work], finish, [output_tensor], async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Reduce ``input`` across ranks and scatter equal pieces into ``output``, as torch does."""
    pg = _member_group(group)
    if pg is None:
        return _TORCH.reduce_scatter_tensor(output, input, op, group, async_op)
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    _check_sizes(input, "input", output.numel() * pg.size(), output.dtype)
    count_call("reduce_scatter_tensor")
    emulate_avg = _emulates_avg(op, pg, input, "reduce_scatter")
    served = _served(pg, [input, output])
    if not emulate_avg and served:
        return _TORCH.reduce_scatter_tensor(output, input, op, pg, async_op)
    reason = "avg" if served else "device"
    target = _comm_device(input, pg)
    with _Staging("reduce_scatter_tensor", pg, reason) as staging:
        source = staging.stage_in([input], target)
        scattered = torch.empty(output.numel(), dtype=output.dtype, device=target)
        finish = staging.finisher(scattered, [output], pg.size() if emulate_avg else 1)
        work = _reduce_scatter_flat(scattered, source, ReduceOp.SUM if emulate_avg else op, pg, True)
        return staging.complete([work], finish, [output], async_op)


def _all_reduce_buckets(name: str, tensors: List[torch.Tensor], op: Any, pg: dist.ProcessGroup,
                        async_op: bool, emulate_avg: bool) -> Optional[Work]:
    """All-reduce ``tensors`` with one flat buffer per (communication device, dtype)."""
    buckets = _buckets(tensors, pg)
    moved = any(t.device != device for (device, _), members in buckets.items() for t in members)
    sent_op = ReduceOp.SUM if emulate_avg else op
    divisor = pg.size() if emulate_avg else 1
    with _Staging(name, pg, "device" if moved else "avg") as staging:
        works, finishes = [], []
        for (device, _), members in buckets.items():
            in_place = len(members) == 1 and members[0].device == device and members[0].is_contiguous()
            buffer = members[0] if in_place else staging.stage_in(members, device)
            finishes.append(staging.finisher(buffer, [] if in_place else members, divisor))
            works.append(_TORCH.all_reduce(buffer, sent_op, pg, True))
        return staging.complete(works, lambda: [finish() for finish in finishes], tensors, async_op)


_BucketKey = Tuple[torch.device, torch.dtype]


def _buckets(tensors: List[torch.Tensor], pg: dist.ProcessGroup) -> Dict[_BucketKey, List[torch.Tensor]]:
    """Group tensors by the device they are reduced on and their dtype, in first-seen order."""
    served = _group_info(pg).device_types
    target: Optional[torch.device] = None  # the staging target, looked up once per call
    buckets: Dict[_BucketKey, List[torch.Tensor]] = {}
    for tensor in tensors:
        if _device_type(tensor) in served:
            device = tensor.device
        else:
            target = target or _staging_target(pg, served)
            device = target
        buckets.setdefault((device, tensor.dtype), []).append(tensor)
    return buckets


def _all_gather_uneven(outputs: List[torch.Tensor], tensor: torch.Tensor, pg: dist.ProcessGroup,
                       async_op: bool) -> Optional[Work]:
    """Gather sizes, pad to the largest, gather, trim: unequal sizes on any backend."""
    target = _comm_device(tensor, pg)
    sizes = _gather_sizes(tensor.numel(), target, pg)
    mismatched = [i for i, (out, n) in enumerate(zip(outputs, sizes)) if out.numel() != n]
    largest = max(sizes)
    with _Staging("all_gather", pg, "uneven") as staging:
        padded = torch.zeros(largest, dtype=tensor.dtype, device=target)
        padded[: tensor.numel()] = staging.stage_in([tensor], target)
        gathered = torch.empty(largest * pg.size(), dtype=tensor.dtype, device=target)
        starts = [i * largest for i in range(pg.size())]
        finish = staging.finisher(gathered, outputs, 1, starts)
        work = _gather_flat(gathered, padded, pg, async_op=True)
        if mismatched:  # every rank still joined the gather, so none is left hanging
            work.wait()
            raise ValueError(
                f"tensor_list[{mismatched[0]}] has {outputs[mismatched[0]].numel()} elements but rank "
                f"{mismatched[0]} sent {sizes[mismatched[0]]}; expected tensor_list[i] sized like rank i's tensor"
            )
        return staging.complete([work], finish, outputs, async_op)


def _gather_sizes(numel: int, device: torch.device, pg: dist.ProcessGroup) -> List[int]:
    sizes = torch.empty(pg.size(), dtype=torch.int64, device=device)
    _gather_flat(sizes, torch.tensor([numel], dtype=torch.int64, device=device), pg, async_op=False)
    return [int(n) for n in sizes.cpu()]


class _Staging:
    """One call's staging: copies in, and after a successful collective, results back.

    Used as a context manager: it counts the traffic, logs the first staging of
    each kind, and notes on an exception what was staged. The caller's tensors
    stay untouched until ``finisher``'s step runs after the collective succeeded.
    """

    def __init__(self, op: str, pg: dist.ProcessGroup, reason: str) -> None:
        self.op = op
        self.pg = pg
        self.reason = reason
        self.nbytes = 0
        self.seconds = 0.0
        self.moves: List[str] = []

    def stage_in(self, tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """A flat copy of ``tensors`` on ``device``."""
        start = time.perf_counter()
        buffer = stage(tensors, device)
        self.seconds += time.perf_counter() - start
        self._record(tensors, device, into=True)
        return buffer

    def finisher(self, buffer: torch.Tensor, targets: List[torch.Tensor], divisor: int = 1,
                 starts: Optional[Sequence[int]] = None) -> Callable[[], None]:
        """The step after the collective: divide for emulated AVG, then write back.

        It holds the op's name, not this object: a work handle keeps it, and what
        a work handle holds must not keep the group alive (see ``DeferredWork``).
        """
        self._record(targets, buffer.device, into=False)
        op = self.op

        def finish() -> None:
            start = time.perf_counter()
            if divisor != 1:
                buffer.div_(divisor)
            restore(buffer, targets, starts)
            count_staging(op, 0, time.perf_counter() - start, new_call=False)

        return finish

    def _record(self, tensors: List[torch.Tensor], device: torch.device, into: bool) -> None:
        moved = [t for t in tensors if t.device != device]
        if moved:
            self.nbytes += sum(t.numel() * t.element_size() for t in moved)
            ends = (moved[0].device, device) if into else (device, moved[0].device)
            self.moves.append(f"{len(moved)} tensor(s) {ends[0]} -> {ends[1]}")

    def complete(self, works: List[Any], finish: Callable[[], Any], outputs: List[torch.Tensor],
                 async_op: bool) -> Optional[Work]:
        """Return the work handle (async), or wait and write back now."""
        work = DeferredWork(works, finish, outputs, self.note())
        if async_op:
            return work
        work.wait()
        return None

    def note(self) -> str:
        if not self.moves:
            return ""
        return f"comm staged {self.op}: {'; '.join(self.moves)}; the caller's tensors are unchanged"

    def __enter__(self) -> "_Staging":
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], trace: Any) -> None:
        count_staging(self.op, self.nbytes, self.seconds, new_call=bool(self.moves))
        log_first_staging(self.op, id(self.pg), self.reason, self._log_message())
        if error is not None and self.moves and not getattr(error, "__notes__", None):
            add_note(error, self.note())

    def _log_message(self) -> str:
        if self.reason == "avg":
            return f"{self.op}: the group's backend lacks a correct ReduceOp.AVG; running SUM, then dividing"
        if self.reason == "uneven":
            return f"{self.op}: unequal sizes; gathering padded to the largest, then trimming"
        served = sorted(_group_info(self.pg).device_types)
        return f"{self.op}: staging {'; '.join(self.moves)} because the group serves only {served}"


def _gather_flat(output: torch.Tensor, input: torch.Tensor, pg: dist.ProcessGroup, *, async_op: bool) -> Any:
    """Gather every rank's ``input`` into the flat ``output``, on any backend.

    gloo's flat all-gather, where it has one, is its list all-gather over chunks of
    the output; gloo in torch 2.1 has none ("no support for _allgather_base"), so
    comm does the same itself for gloo.
    """
    if _group_info(pg).backends.get(_device_type(input)) == "gloo":
        return _TORCH.all_gather(list(output.chunk(pg.size())), input, pg, async_op)
    return _all_gather_flat(output, input, pg, async_op)


def _member_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group to use, or None when this rank is not a member (torch then returns)."""
    if group is not None and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return _resolve_group(group)


def _served(pg: dist.ProcessGroup, tensors: List[torch.Tensor]) -> bool:
    """Whether ``pg`` serves every one of ``tensors`` where it lies."""
    served = _group_info(pg).device_types
    for tensor in tensors:
        if _device_type(tensor) not in served:
            return False
    return True


def _comm_device(tensor: torch.Tensor, pg: dist.ProcessGroup) -> torch.device:
    """The device ``tensor`` is communicated on: its own if served, else the staging target."""
    served = _group_info(pg).device_types
    return tensor.device if tensor.device.type in served else _staging_target(pg, served)


def _emulates_avg(op: Any, pg: dist.ProcessGroup, tensor: torch.Tensor, kind: str) -> bool:
    """True when AVG must run as SUM then divide; raises torch's error for integer tensors."""
    if op is _SUM or op != _AVG or _native_avg(pg, _comm_device(tensor, pg).type, kind):
        return False
    torch.empty(0, dtype=tensor.dtype).div_(2)  # torch's own error for integer and bool tensors
    return True


def _device_type(tensor: torch.Tensor) -> str:
    # is_cpu and is_cuda are plain flags; building a torch.device costs enough to
    # measurably delay a small collective (see benchmarks/overhead.py).
    if tensor.is_cpu:
        return "cpu"
    if tensor.is_cuda:
        return "cuda"
    return tensor.device.type


def _check_tensor(tensor: Any, name: str) -> str:
    """Refuse what is not a tensor with data; return its device type."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    device_type = _device_type(tensor)
    if device_type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no data; expected a tensor with storage")
    return device_type


def _check_tensor_list(tensors: Any, name: str, length: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(tensors).__name__}")
    if length is not None and len(tensors) != length:
        raise ValueError(f"{name} has {len(tensors)} tensors; expected one per rank of the group ({length})")
    for i, tensor in enumerate(tensors):
        _check_tensor(tensor, f"{name}[{i}]")
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"{name}[{i}] has dtype {tensor.dtype}; expected {dtype} like the input tensor")
    return list(tensors)


def _check_sizes(tensor: torch.Tensor, name: str, numel: int, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected {dtype}")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; expected {numel} (group size times the piece size)")


def _root(pg: dist.ProcessGroup, rank: Optional[int], group_rank: Optional[int], name: str) -> Tuple[int, int]:
    """Validate ``src``/``dst`` (global) or ``group_src``/``group_dst``; return the root's group and global rank."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"pass {name} or group_{name}, not both")
    if rank is None and group_rank is None:
        raise ValueError(f"{name} (a global rank) or group_{name} (a rank in the group) is required")
    label, value = (f"group_{name}", group_rank) if group_rank is not None else (name, rank)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    if group_rank is None:
        ranks = dist.get_process_group_ranks(pg)
        if value not in ranks:
            raise ValueError(f"{name}={value} is not a rank of the group; expected one of {ranks}")
        return ranks.index(value), value
    if not 0 <= value < pg.size():
        raise ValueError(f"group_{name}={value} is out of range; expected 0 <= group_{name} < {pg.size()}")
    return value, dist.get_global_rank(pg, value)


def _given(**kwargs: Any) -> Dict[str, Any]:
    """Only the keyword arguments that were given (older torch lacks group_src/group_dst)."""
    return {key: value for key, value in kwargs.items() if value is not None}
