"""Staging in plain Python, for where comm's staging backend cannot be built.

Without a C++ compiler, or on a torch the backend does not support, c10d has no
backend for the devices a group's own backend does not serve; and c10d hands a call
whose tensors lie on different devices whole to the backend of its input's device.
comm's explicit calls then stage themselves: each tensor on such a device is copied onto the
group's device, torch's call runs on the copies, and what the call writes is
copied back into the caller's tensors (after ``wait()`` for an async call). Nothing
is written when the call fails. Code that calls torch directly is not staged.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

from comm.groups import resolve_group, served_types
from comm.observability import count_staged
from comm.slot import own_types, target_device
from comm.work import DeferredWork

__all__ = ["group_of", "mixes_devices", "run"]

_GROUP_INDEX: Dict[str, int] = {}


def group_of(name: str, torch_call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The ``group`` argument of a call (None for the default group), without binding every argument."""
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", ())
        return ops[0].group if isinstance(ops, list) and ops and isinstance(ops[0], dist.P2POp) else None
    if "group" in kwargs:
        return kwargs["group"]
    index = _GROUP_INDEX.get(name)
    if index is None:
        index = _GROUP_INDEX[name] = list(inspect.signature(torch_call).parameters).index("group")
    return args[index] if len(args) > index else None


def mixes_devices(args: Any, kwargs: Any) -> bool:
    """Whether a call's tensors (in any argument, or in lists) lie on more than one device type."""
    seen = set()
    for value in (*args, *kwargs.values()):
        for tensor in _tensors_in(value):
            seen.add(tensor.device.type)
    return len(seen) > 1


def _tensors_in(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    return []


class _Copies:
    """The copies one call made: onto the group's device, and back into the caller's tensors."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        pg = resolve_group(group)
        self.served: FrozenSet[str] = own_types(pg) or served_types(pg)
        self.target = target_device(pg, self.served)
        self.moved = 0
        self.bytes = 0
        self.back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.started = time.perf_counter()

    def stage(self, value: Any, reads: bool, writes: bool) -> Any:
        """``value`` (a tensor, a list of them, or a list of lists) with unserved tensors replaced by copies."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.stage(item, reads, writes) for item in value)
        if not isinstance(value, torch.Tensor) or value.device.type in self.served:
            return value
        staged = value.to(self.target) if reads else torch.empty_like(value, device=self.target)
        if reads:
            self.moved, self.bytes = self.moved + 1, self.bytes + value.nbytes
        if writes:
            self.back.append((value, staged))
        return staged

    def any(self) -> bool:
        return self.moved > 0 or bool(self.back)

    def write_back(self, name: str) -> None:
        for caller, staged in self.back:
            caller.copy_(staged)
        moved = self.moved + len(self.back)
        nbytes = self.bytes + sum(caller.nbytes for caller, _ in self.back)
        count_staged(name, moved, nbytes, time.perf_counter() - self.started)

    def finish(self, name: str, result: Any, async_op: bool) -> Any:
        if not async_op:
            self.write_back(name)
            return result
        outputs = [caller for caller, _ in self.back]
        works = result if isinstance(result, list) else [result]
        handles = [DeferredWork(works, lambda: self.write_back(name), outputs) for _ in works]
        return handles if isinstance(result, list) else handles[0]


def run(name: str, collective: Any, torch_call: Callable[..., Any], call: Callable[..., Any], args: Any,
        kwargs: Any) -> Any:
    """``call`` (with ``torch_call``'s signature) with every tensor on an unserved device staged onto a served one.

    ``collective`` is the call's row of :data:`comm.collectives.COLLECTIVES`: what it reads, writes, and whether
    it always returns a work."""
    if name == "batch_isend_irecv":
        return _batch(call, *args, **kwargs) if group_of(name, torch_call, args, kwargs) else call(*args, **kwargs)
    bound = inspect.signature(torch_call).bind(*args, **kwargs)
    copies = _Copies(bound.arguments.get("group"))
    for parameter in dict.fromkeys((*collective.reads, *collective.writes)):
        if bound.arguments.get(parameter) is not None:
            bound.arguments[parameter] = copies.stage(bound.arguments[parameter], parameter in collective.reads,
                                                      parameter in collective.writes)
    if not copies.any():
        return call(*args, **kwargs)
    async_op = bool(bound.arguments.get("async_op", False)) or collective.always_async
    return copies.finish(name, call(*bound.args, **bound.kwargs), async_op)


def _batch(call: Callable[..., Any], p2p_op_list: List[Any]) -> Any:
    """``batch_isend_irecv`` with each operation's tensor staged; each handle writes back its receives."""
    if not p2p_op_list:
        return call(p2p_op_list)
    copies = _Copies(p2p_op_list[0].group)
    staged = [
        dist.P2POp(op.op, copies.stage(op.tensor, reads=op.op is dist.isend, writes=op.op is dist.irecv), op.peer,
                   op.group, op.tag)
        for op in p2p_op_list
    ]
    if not copies.any():
        return call(p2p_op_list)
    return copies.finish("batch_isend_irecv", call(staged), async_op=True)
