"""Point-to-point: send, recv and their batches, on whatever device each side's tensor lives.

Each rank stages its own side: a CPU tensor sent over an hccl group is copied onto
the NPU and sent from there, and the peer receives into whatever tensor it
passed (an NPU tensor directly, a CPU tensor through a buffer written back after
the receive). So a CPU tensor sent to a rank that receives into an NPU tensor,
and the reverse, both work.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from comm.arguments import check_peer, check_tensor, given
from comm.backend import _GroupInfo, _resolve_group
from comm.fastpath import fast_group, fast_tensor, namespace, served, slow_path
from comm.observability import call_counter, count_staging
from comm.staging import Staging
from comm.work import DeferredWork, attribute_work

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]

# torch's own functions, captured at import so that comm.patch() cannot make the
# wrappers call themselves.
_TORCH = namespace("comm.p2p._TORCH", {name: getattr(dist, name) for name in __all__ if name != "P2POp"})
# torch's isend and irecv themselves, which a P2POp's op is compared with: while
# comm.profile() runs, _TORCH holds timing wrappers of them.
_TORCH_ISEND, _TORCH_IRECV = dist.isend, dist.irecv
_COUNT = namespace("comm.p2p._COUNT", {name: call_counter(name) for name in __all__ if name != "P2POp"})

Work = Any  # torch's work object, or comm's DeferredWork


def send(tensor: torch.Tensor, dst: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, tag: int = 0,
         group_dst: Optional[int] = None) -> None:
    """Send ``tensor`` to ``dst`` (a global rank) or ``group_dst`` and wait, as torch does."""
    if _fast_peer(group, tensor, dst, group_dst):
        _COUNT.send()
        # torch's send is isend and wait; its own goes through the module's isend, comm's under the patch
        work = _TORCH.isend(tensor, dst, group, tag)
        attribute_work(work, "send")  # for comm.profile(): a send, though it ran as torch's isend
        work.wait()
        return None
    slow_path("send", group, _send, tensor, dst, tag, group_dst, False)
    return None


def isend(tensor: torch.Tensor, dst: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, tag: int = 0,
          group_dst: Optional[int] = None) -> Optional[Work]:
    """Start sending ``tensor`` to ``dst`` or ``group_dst``; return the work handle, as torch does."""
    if _fast_peer(group, tensor, dst, group_dst):
        _COUNT.isend()
        return _TORCH.isend(tensor, dst, group, tag)
    return slow_path("isend", group, _send, tensor, dst, tag, group_dst, True)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, tag: int = 0,
         group_src: Optional[int] = None) -> int:
    """Receive into ``tensor`` from ``src`` (any source when None); return the sender's global rank, as torch does."""
    if _fast_peer(group, tensor, src, group_src, any_source=True):
        _COUNT.recv()
        # torch's recv is irecv and wait; its own goes through the module's irecv, comm's under the patch
        work = _TORCH.irecv(tensor, src, group, tag)
        attribute_work(work, "recv")  # for comm.profile(): a recv, though it ran as torch's irecv
        return _received(work, group, src)
    started = slow_path("recv", group, _start_recv, "recv", tensor, src, tag, group_src)
    if started is None:  # this rank is not in the group: torch's answer
        return -1
    handle, src_global = started
    attribute_work(handle, "recv")  # for comm.profile(): a recv, though it ran as torch's irecv
    return _received(handle, group, src_global)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[dist.ProcessGroup] = None, tag: int = 0,
          group_src: Optional[int] = None) -> Optional[Work]:
    """Start receiving into ``tensor`` from ``src`` (any source when None); return the work handle, as torch does."""
    if _fast_peer(group, tensor, src, group_src, any_source=True):
        _COUNT.irecv()
        return _TORCH.irecv(tensor, src, group, tag)
    started = slow_path("irecv", group, _start_recv, "irecv", tensor, src, tag, group_src)
    return None if started is None else started[0]


class P2POp(dist.P2POp):
    """torch's ``P2POp``, which also accepts ``comm.isend`` and ``comm.irecv`` as its ``op``.

    It stores the isend or irecv that torch's ``batch_isend_irecv`` compares
    ``op`` against, so either batch function (comm's or torch's) takes it as is.
    """

    def __new__(cls, op: Callable[..., Any], tensor: torch.Tensor, peer: Optional[int] = None,
                group: Optional[dist.ProcessGroup] = None, tag: int = 0, group_peer: Optional[int] = None) -> "P2POp":
        _direction(op, "op")
        check_tensor(tensor, "tensor")
        return object.__new__(cls)

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: Optional[int] = None,
                 group: Optional[dist.ProcessGroup] = None, tag: int = 0, group_peer: Optional[int] = None) -> None:
        super().__init__(_current(op), tensor, peer, group, tag, **given(group_peer=group_peer))


def batch_isend_irecv(p2p_op_list: List[dist.P2POp]) -> List[Work]:
    """Start every send and receive of ``p2p_op_list`` as one batch; return their work handles, as torch does.

    Where torch coalesces the batch into fewer works (NCCL), each handle comm
    returns waits for the whole batch and writes back every staged receive.
    """
    if _fast_batch(p2p_op_list):
        _COUNT.batch_isend_irecv()
        return list(_TORCH.batch_isend_irecv(p2p_op_list))
    ops = _check_ops(p2p_op_list)
    works: Optional[List[Work]] = slow_path("batch_isend_irecv", ops[0].group, _batch, ops)
    return [] if works is None else works  # not in the group: torch starts nothing either


def _batch(pg: dist.ProcessGroup, info: _GroupInfo, ops: List[dist.P2POp]) -> List[Work]:
    if served(info, [op.tensor for op in ops]):
        return list(_TORCH.batch_isend_irecv([_for_torch(op, op.tensor) for op in ops]))
    # One staging per op (each handle writes back its own receive); the batch counts as one staged call.
    stagings = [Staging("batch_isend_irecv", pg, info, counts_call=False) for _ in ops]
    with contextlib.ExitStack() as stack:
        for staging in stagings:
            stack.enter_context(staging)
        staged = [_for_torch(op, _staged_tensor(op, staging)) for op, staging in zip(ops, stagings)]
        count_staging("batch_isend_irecv", 0, 0.0, new_call=any(staging.staged for staging in stagings))
        works = list(_TORCH.batch_isend_irecv(staged))
        if len(works) == len(ops):
            for staging, work in zip(stagings, works):
                staging.issue(work)
            return [staging.handle([op.tensor]) for staging, op in zip(stagings, ops)]
        for staging in stagings:
            for work in works:
                staging.issue(work)
        handles = [staging.handle([op.tensor]) for staging, op in zip(stagings, ops)]
        return [_whole_batch(works, handles, [op.tensor for op in ops])] * len(works)


def _whole_batch(works: List[Any], handles: List[DeferredWork], tensors: List[torch.Tensor]) -> DeferredWork:
    """One handle for a batch torch coalesced into fewer works: it writes back every staged receive."""

    def write_all() -> None:
        for handle in handles:
            handle.wait()

    return DeferredWork(works, write_all, tensors, lambda: "")


def _fast_batch(ops: Any) -> bool:
    """Whether torch can take the batch as it is: ops built with its current isend/irecv, on served tensors."""
    if type(ops) is not list or not ops or not isinstance(ops[0], dist.P2POp):
        return False
    group, send, receive = ops[0].group, c10d.isend, c10d.irecv
    info = fast_group(group, ops[0].tensor)
    if info is None:
        return False
    for op in ops:
        if not isinstance(op, dist.P2POp) or not (op.op is send or op.op is receive) or op.group is not group:
            return False
        if not fast_tensor(info, op.tensor):
            return False
    return True


def _fast_peer(group: Optional[dist.ProcessGroup], tensor: Any, peer: Any, group_peer: Optional[int],
               any_source: bool = False) -> bool:
    """Whether torch can take this point-to-point call as it is: served tensor, valid peer other than this rank."""
    info = fast_group(group, tensor)
    if info is None or group_peer is not None:
        return False
    if peer is None:
        return any_source
    return type(peer) is int and info.group_ranks.get(peer, info.rank) != info.rank


def _send(pg: dist.ProcessGroup, info: _GroupInfo, tensor: torch.Tensor, dst: Optional[int], tag: int,
          group_dst: Optional[int], async_op: bool) -> Optional[Work]:
    check_tensor(tensor, "tensor")
    _, dst_global = check_peer(info, dst, group_dst, "dst")
    if served(info, [tensor]):
        work = _TORCH.isend(tensor, dst_global, pg, tag)
        if async_op:
            return work
        attribute_work(work, "send")  # for comm.profile(): a send, though it ran as torch's isend
        work.wait()
        return None
    with Staging("isend" if async_op else "send", pg, info) as staging:
        staging.issue(_TORCH.isend(staging.send(tensor), dst_global, pg, tag))
        return staging.finish(async_op, [tensor])


def _start_recv(pg: dist.ProcessGroup, info: _GroupInfo, name: str, tensor: torch.Tensor, src: Optional[int],
                tag: int, group_src: Optional[int]) -> Tuple[Work, Optional[int]]:
    """Start a receive (staged where the group does not serve ``tensor``): its work and the source's global rank."""
    check_tensor(tensor, "tensor")
    src_global = None if src is None and group_src is None else check_peer(info, src, group_src, "src")[1]
    if served(info, [tensor]):
        return _TORCH.irecv(tensor, src_global, pg, tag), src_global
    with Staging(name, pg, info) as staging:
        staging.issue(_TORCH.irecv(staging.receive(tensor), src_global, pg, tag))
        return staging.handle([tensor]), src_global


def _received(work: Work, group: Optional[dist.ProcessGroup], src: Optional[int]) -> int:
    """Wait for a receive; the sender's global rank, as torch's recv returns it (any source: the work says)."""
    work.wait()
    if src is not None:
        return src
    return dist.get_global_rank(_resolve_group(group), work._source_rank())


def _direction(op: Any, name: str) -> str:
    """"send" or "recv" for torch's isend/irecv, comm's, or a ``comm.patch()`` stand-in of either.

    Its error keeps torch's type and opening words (``Invalid ``op```` ), which
    code written against torch may match.
    """
    original = getattr(op, "__comm_replaces__", op)
    if original is _TORCH_ISEND or op is isend:
        return "send"
    if original is _TORCH_IRECV or op is irecv:
        return "recv"
    raise ValueError(f"Invalid ``op``: {name} must be torch.distributed.isend or irecv (or comm's), got {op!r}")


def _check_ops(p2p_op_list: Any) -> List[dist.P2POp]:
    """Refuse what is not a non-empty list of P2POps on one group, with torch's exception type and opening words."""
    if not isinstance(p2p_op_list, list) or not p2p_op_list:
        raise ValueError(f"Invalid ``p2p_op_list``: expected a non-empty list of P2POp, got {p2p_op_list!r}")
    for i, op in enumerate(p2p_op_list):
        if not isinstance(op, dist.P2POp):
            raise ValueError(f"Invalid ``p2p_op_list``: p2p_op_list[{i}] must be a torch.distributed.P2POp, "
                             f"got {type(op).__name__}")
        _direction(op.op, f"p2p_op_list[{i}].op")
        check_tensor(op.tensor, f"p2p_op_list[{i}].tensor")
        if op.group != p2p_op_list[0].group:
            raise ValueError(f"All ops need to use the same group: p2p_op_list[{i}] is on another group than "
                             "p2p_op_list[0]")
    return p2p_op_list


def _staged_tensor(op: dist.P2POp, staging: Staging) -> torch.Tensor:
    """What ``op`` sends or receives into, on a device the group serves."""
    return staging.send(op.tensor) if _direction(op.op, "op") == "send" else staging.receive(op.tensor)


def _for_torch(op: dist.P2POp, tensor: torch.Tensor) -> dist.P2POp:
    """``op`` on ``tensor``, built with the isend/irecv that torch's batch compares ``op.op`` against.

    torch picks the peer's keyword by ``op.op is isend`` (its module's current
    function: a stand-in under ``comm.patch()``), so an op built with comm's or
    torch's original function is rebuilt.
    """
    current = _current(op.op)
    if op.op is current and tensor is op.tensor:
        return op
    return dist.P2POp(current, tensor, op.peer, op.group, op.tag)


def _current(op: Any) -> Callable[..., Any]:
    """The isend or irecv (per ``op``'s direction) that torch's module holds now: a stand-in under the patch."""
    return c10d.isend if _direction(op, "op") == "send" else c10d.irecv
