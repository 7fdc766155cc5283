"""comm's explicit calls staged in plain Python, for hosts where comm's staging backend cannot be built.

There (no C++ compiler, a torch older than comm's floor, ``COMM_STAGING=0``) c10d has
no backend for the devices a group's own backend does not serve, and nothing stages a
call whose tensors lie on different devices. comm's explicit calls then stage
themselves: each tensor on such a device is copied onto the group's device, torch's
call runs on the copies, and what the call writes is copied back into the caller's
tensors (after ``wait()`` for an async call). Nothing is written when the call fails.
Code that calls torch directly is not staged. Wherever the backend is built, comm's
calls are torch's, and the C++ stages (comm/csrc).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

from comm.groups import device_types_of, resolve_group
from comm.observability import count_staged
from comm.slot import own_types, target_device
from comm.work import DeferredWork

__all__ = ["run"]


class _Copies:
    """The copies one call made: onto the group's device, and back into the caller's tensors."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        pg = resolve_group(group)
        self.kept: FrozenSet[str] = own_types(pg) or device_types_of(pg)  # types whose tensors stay where they are
        self.target = target_device(pg, self.kept)
        self.moved = 0
        self.bytes = 0
        self.back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.started = time.perf_counter()

    def stage(self, value: Any, reads: bool, writes: bool) -> Any:
        """``value`` (a tensor, a list of them, or a list of lists) with unserved tensors replaced by copies."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.stage(item, reads, writes) for item in value)
        if not isinstance(value, torch.Tensor) or value.device.type in self.kept:
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


def run(name: str, collective: Any, torch_call: Callable[..., Any], call: Callable[..., Any], kwargs: Any) -> Any:
    """``call(**kwargs)`` (``torch_call``'s signature) with every tensor on an unserved device staged onto a served one.

    ``collective`` is the call's row of :data:`comm.collectives.COLLECTIVES`: what it reads, writes, and whether
    it always returns a work."""
    if name == "batch_isend_irecv":
        return _batch(call, **kwargs)
    bound = inspect.signature(torch_call).bind(**kwargs)
    copies = _Copies(bound.arguments.get("group"))
    for parameter in dict.fromkeys((*collective.reads, *collective.writes)):
        if bound.arguments.get(parameter) is not None:
            bound.arguments[parameter] = copies.stage(bound.arguments[parameter], parameter in collective.reads,
                                                      parameter in collective.writes)
    if not copies.any():
        return call(**kwargs)
    async_op = bool(bound.arguments.get("async_op", False)) or collective.always_async
    return copies.finish(name, call(*bound.args, **bound.kwargs), async_op)


def _batch(call: Callable[..., Any], p2p_op_list: List[Any]) -> Any:
    """``batch_isend_irecv`` with each operation's tensor staged; each handle writes back its receives."""
    listed = isinstance(p2p_op_list, list) and all(isinstance(op, dist.P2POp) for op in p2p_op_list)
    if not p2p_op_list or not listed:
        return call(p2p_op_list)  # torch's own error for what is not a list of P2POps
    copies = _Copies(p2p_op_list[0].group)
    staged = [
        dist.P2POp(op.op, copies.stage(op.tensor, reads=_named(op.op) == "isend", writes=_named(op.op) == "irecv"),
                   op.peer, op.group, op.tag)
        for op in p2p_op_list
    ]
    if not copies.any():
        return call(p2p_op_list)
    return copies.finish("batch_isend_irecv", call(staged), async_op=True)


def _named(function: Any) -> str:
    """A P2POp's function by name: torch's isend, comm's, or a profile's timing wrapper of either."""
    return str(getattr(function, "__name__", ""))
