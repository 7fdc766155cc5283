"""Staging: running a collective whose tensors live where the group's backend does not serve them.

A collective on a group whose backend does not serve the tensor's device (a CPU
gradient norm on an nccl or hccl group) fails in torch. This module is the one
place that moves tensors for it:

* :func:`staging_device` names the device to move a tensor to;
* :class:`Staging` copies a call's inputs there (one transfer per tensor or list),
  lets the collective run on the copies, and writes the results back into the
  caller's tensors (one transfer per tensor or list), dividing first where it
  emulates ``ReduceOp.AVG``; its handle (:class:`comm.work.DeferredWork`) does
  the writing back on ``wait()`` for async calls.

The caller's tensors are only written after the collective succeeded, so a
failure leaves them as they were. Whether a call needs staging at all is
:mod:`comm.fastpath`'s question.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, ContextManager, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._C._autograd import _profiler_enabled
from torch.autograd.profiler import record_function
from torch.distributed import ReduceOp

from comm.arguments import device_type
from comm.backend import _group_info, _GroupCache, _GroupInfo, _native_avg, _resolve_group
from comm.device import _is_available, accelerator_type, bound_device, current_device
from comm.fastpath import served
from comm.observability import count_staging, log_first_staging
from comm.work import DeferredWork, add_note, attribute_work

__all__ = ["staging_device"]

_SUM, _AVG = ReduceOp.SUM, ReduceOp.AVG
_UNTRACED = contextlib.nullcontext()
# What the first staging log says of a call that emulates ReduceOp.AVG (eager or compiled).
AVG_AS_SUM = "the group's backend lacks a correct ReduceOp.AVG; running SUM, then dividing"
# Per group, the staging target of a bound process or group and the bound device it came from.
_TARGETS = _GroupCache()


def staging_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> Optional[torch.device]:
    """The device ``tensor`` must be staged onto for ``group``, or None if it is served natively.

    The target is the group's bound device (``init_process_group(device_id=...)``)
    if any, else the device :func:`comm.bind` bound this process to (whichever
    thread calls), else the calling thread's current device of a device type the
    backend serves, else the CPU for a CPU backend.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    pg = _resolve_group(group)
    info = _group_info(pg)
    if tensor.device.type in info.device_types:
        return None
    return _staging_target(pg, info)


def _staging_target(group: dist.ProcessGroup, info: _GroupInfo) -> torch.device:
    cached: Optional[Tuple[Optional[torch.device], torch.device]] = _TARGETS.get(group)
    if cached is not None and cached[0] is bound_device():
        return cached[1]
    served = info.device_types
    for bound in (getattr(group, "bound_device_id", None), bound_device()):
        if bound is not None and bound.type in served:
            # Fixed for the group until bind() binds another device: asked once, not per call.
            target = torch.device(bound)
            _TARGETS.set(group, (bound_device(), target))
            return target
    accelerator = accelerator_type()
    if accelerator in served:
        return current_device(accelerator)
    for kind in sorted(served - {"cpu"}):
        if _is_available(kind):
            return current_device(kind)
    if "cpu" in served:
        return torch.device("cpu")
    raise RuntimeError(
        f"the group's backend serves device types {sorted(served)}, none of which is available in this process"
    )


def emulates_avg(op: Any, pg: dist.ProcessGroup, info: _GroupInfo, tensor: torch.Tensor, kind: str) -> bool:
    """True when AVG must run as SUM then divide; raises torch's error for integer tensors first."""
    if op is _SUM or op != _AVG:
        return False
    where = device_type(tensor) if device_type(tensor) in info.device_types else _staging_target(pg, info).type
    if _native_avg(pg, where, kind):
        return False
    torch.empty(0, dtype=tensor.dtype).div_(2)  # torch's own error for integer and bool tensors
    return True


def _traced(name: str) -> ContextManager[Any]:
    """A range named ``name`` in torch's profiler trace while it records, else nothing (one C call to ask)."""
    return record_function(name) if _profiler_enabled() else _UNTRACED


# A buffer the collective wrote, the caller's tensors it goes back into, and where
# each one's piece starts (None: packed back to back).
_Restore = Tuple[torch.Tensor, List[torch.Tensor], Optional[List[int]]]
# What one transfer moved, for logs and notes: how many tensors, from where, to where
# (a device, or a tensor standing for its own).
_Move = Tuple[int, Any, Any]


class Staging:
    """One staged call: copies in, torch's collective on them, and the results written back.

    Used as a context manager around issuing the collective (with
    ``async_op=True``); :meth:`finish` waits and writes back, or returns the work
    handle that will. It counts the traffic, logs the first staging of each kind
    per group, and notes on an exception what was staged. ``average`` runs
    ``ReduceOp.AVG`` as SUM, then divides what the collective wrote by the group size.
    ``counts_call=False`` leaves counting the staged call to the caller (a batch of
    point-to-point calls is one call, staged op by op).
    """

    def __init__(self, name: str, pg: dist.ProcessGroup, info: _GroupInfo, average: bool = False,
                 reason: Optional[str] = None, counts_call: bool = True) -> None:
        self.name = name
        self._pg = pg
        self._info = info
        self._average = average
        self._divisor = info.size if average else 1
        self._counts_call = counts_call
        self._reason = reason  # None: "device" where something moved, else "avg"
        self._target: Optional[torch.device] = None
        self._works: List[Any] = []
        self._restores: List[_Restore] = []
        self._divided: List[torch.Tensor] = []
        self._moves: List[_Move] = []
        self._nbytes = 0
        self._seconds = 0.0

    def op(self, op: Any) -> Any:
        """The reduce op to send: SUM where AVG is emulated (even at world size 1, where NCCL's AVG is wrong)."""
        return _SUM if self._average else op

    @property
    def staged(self) -> bool:
        """Whether this call moved anything between devices or emulates AVG: what makes it a staged call."""
        return bool(self._moves) or self._average

    @property
    def target(self) -> torch.device:
        """The device that tensors the group does not serve are staged onto."""
        if self._target is None:
            self._target = _staging_target(self._pg, self._info)
        return self._target

    def where(self, tensor: torch.Tensor) -> torch.device:
        """The device ``tensor`` is communicated on: its own if served, else the target."""
        return tensor.device if device_type(tensor) in self._info.device_types else self.target

    def send(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the collective can read it: itself if served, else a copy on the target."""
        if device_type(tensor) in self._info.device_types:
            return tensor
        return self._copy_in(tensor)

    def _copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` on the target, contiguous: the one transfer in."""
        target, start = self.target, time.perf_counter()
        if _profiler_enabled():
            with record_function("comm.stage_in"):
                copy = tensor.to(target, copy=True, memory_format=torch.contiguous_format)
        else:
            copy = tensor.to(target, copy=True, memory_format=torch.contiguous_format)
        self._moved([tensor], tensor, target, start)
        return copy

    def send_all(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """A list where the collective can read it: itself if served, else views of one flat copy."""
        if served(self._info, tensors):
            return tensors
        return _pieces(self._flat_copy(tensors), tensors)

    def receive(self, tensor: torch.Tensor, reads: bool = False) -> torch.Tensor:
        """Where the collective writes ``tensor``'s result: itself if served, else a buffer on the target.

        ``reads`` copies the current values in first (in-place collectives).
        """
        if device_type(tensor) in self._info.device_types:
            if self._divisor != 1:
                self._divided.append(tensor)
            return tensor
        buffer = self._copy_in(tensor) if reads else torch.empty(tensor.shape, dtype=tensor.dtype, device=self.target)
        self._write_back_later(buffer, [tensor], None, moved_to=tensor)  # back onto the tensor's own device
        return buffer

    def receive_all(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Where the collective writes a list: itself if served, else views of one flat buffer."""
        if served(self._info, tensors):
            if self._divisor != 1:
                self._divided.extend(tensors)
            return tensors
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=self.target)
        unserved = next(t for t in tensors if device_type(t) not in self._info.device_types)
        self._write_back_later(flat, tensors, None, moved_to=unserved)
        return _pieces(flat, tensors)

    def receive_joined(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """One flat buffer holding ``tensors`` (one device and dtype) where the collective runs, written back after.

        Coalescing: one collective for many tensors, even served ones; a single
        served contiguous tensor is used as it is.
        """
        single = tensors[0]
        served_here = device_type(single) in self._info.device_types
        if len(tensors) == 1 and (single.is_contiguous() or not served_here):
            return self.receive(single, reads=True)  # itself where served, else a copy of its shape
        flat = self._flat_copy(tensors, single.device if served_here else self.target)
        self._write_back_later(flat, tensors, None, moved_to=None if served_here else single)
        return flat

    def receive_flat(self, tensors: List[torch.Tensor], starts: Optional[List[int]], numel: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """A flat buffer of ``numel`` elements whose piece at ``starts[i]`` is written back into ``tensors[i]``.

        ``starts`` None: the pieces are packed back to back.
        """
        flat = torch.empty(numel, dtype=dtype, device=device)
        self._write_back_later(flat, tensors, starts, moved_to=tensors[0] if flat.device != tensors[0].device else None)
        return flat

    def issue(self, work: Any) -> None:
        """Keep the work of a collective issued on the staged tensors (comm.profile() files it under this call)."""
        self._works.append(work)
        attribute_work(work, self.name)

    def finish(self, async_op: bool, outputs: List[torch.Tensor]) -> Optional[DeferredWork]:
        """Wait and write back now (sync), or return the handle whose ``wait()`` will (async).

        ``outputs``: the caller's tensors the call writes, which the handle's
        ``result()`` and future hold, as torch's do.
        """
        if async_op:
            return self.handle(outputs)
        for work in self._works:
            work.wait()
        self._seconds += _write(self._restores, self._divided, self._divisor)  # counted once, on exit
        return None

    def handle(self, outputs: List[torch.Tensor]) -> DeferredWork:
        """The work handle of the issued collectives: its ``wait()`` also writes the results back."""
        # The note reads the name and moves, never this object: a handle must not keep the group alive.
        return DeferredWork(self._works, self._writer(), outputs, functools.partial(_note, self.name, self._moves))

    def _writer(self) -> Callable[[], None]:
        """The write-back for a handle: it holds the tensors and the op's name, never this object (the group)."""
        return functools.partial(_write_and_count, self.name if self.staged else None, self._restores,
                                 self._divided, self._divisor)

    def _write_back_later(self, buffer: torch.Tensor, targets: List[torch.Tensor], starts: Optional[List[int]],
                          moved_to: Optional[torch.Tensor]) -> None:
        """Plan writing ``buffer`` back into ``targets`` once the collective succeeded.

        ``moved_to``: a target on another device than ``buffer``, which names the
        move's destination (None: nothing moves).
        """
        self._restores.append((buffer, targets, starts))
        if moved_to is not None:
            self._moved(targets, buffer, moved_to)

    def _flat_copy(self, tensors: List[torch.Tensor], device: Optional[torch.device] = None) -> torch.Tensor:
        """One flat copy of ``tensors`` (one device) on ``device`` (the target): joined, then one transfer."""
        device = self.target if device is None else device
        start = time.perf_counter()
        with _traced("comm.stage_in"):
            if len(tensors) == 1:  # reshape copies a strided tensor already: then moving it is the one copy
                copy = tensors[0].reshape(-1).to(device, copy=tensors[0].is_contiguous())
            else:  # cat makes the copy; moving it is the one transfer
                copy = torch.cat([t.reshape(-1) for t in tensors]).to(device)
        if device != tensors[0].device:
            self._moved(tensors, tensors[0], device, start)
        return copy

    def _moved(self, tensors: List[torch.Tensor], source: Any, dest: Any, start: Optional[float] = None) -> None:
        """Count one transfer of ``tensors`` from ``source`` to ``dest`` (devices, or tensors standing for theirs).

        ``start``: when the transfer began, for a copy made now (a write-back is timed when it runs).
        """
        if start is not None:
            self._seconds += time.perf_counter() - start
        self._nbytes += sum([t.numel() * t.element_size() for t in tensors])
        self._moves.append((len(tensors), source, dest))

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], trace: Any) -> None:
        if self.staged:  # a coalesced call on served tensors stages nothing: nothing to count or say
            count_staging(self.name, self._nbytes, self._seconds, new_call=self._counts_call and bool(self._moves))
            reason = self._reason or ("device" if self._moves else "avg")
            log_first_staging(self.name, id(self._pg), reason, self._log_message)
        if error is not None and self._moves and not getattr(error, "__notes__", None):
            add_note(error, _note(self.name, self._moves))

    def _log_message(self) -> str:
        if self._reason is None and not self._moves:
            return f"{self.name}: {AVG_AS_SUM}"
        if self._reason == "uneven":
            return f"{self.name}: unequal sizes; gathering padded to the largest, then trimming"
        return f"{self.name}: staging {_describe(self._moves)} because the group serves only " \
               f"{sorted(self._info.device_types)}"


def _note(name: str, moves: List[_Move]) -> str:
    """What was staged, for an exception's notes: built only when something failed."""
    return f"comm staged {name}: {_describe(moves)}; the caller's tensors are unchanged" if moves else ""


def _describe(moves: List[_Move]) -> str:
    return "; ".join(f"{count} tensor(s) {_place(source)} -> {_place(dest)}" for count, source, dest in moves)


def _place(where: Any) -> torch.device:
    """A move's end: a device, or a tensor standing for its own."""
    return where.device if isinstance(where, torch.Tensor) else where


def _pieces(flat: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Views of consecutive pieces of ``flat`` shaped like ``like``: one split, and a view only where shaped."""
    pieces = torch.split(flat, [t.numel() for t in like])
    return [piece if t.dim() == 1 else piece.view(t.shape) for piece, t in zip(pieces, like)]


def _write_and_count(name: Optional[str], restores: List[_Restore], divided: List[torch.Tensor],
                     divisor: int) -> None:
    """An async handle's write-back, its time counted for ``name`` (None: nothing was staged)."""
    seconds = _write(restores, divided, divisor)
    if name is not None:
        count_staging(name, 0, seconds, new_call=False)


def _write(restores: List[_Restore], divided: List[torch.Tensor], divisor: int) -> float:
    """The step after the collective: divide for emulated AVG, then write the results back; its seconds.

    Every division runs before any write-back, so a division that fails leaves
    the caller's tensors as they were. Like c10d, it writes in place whatever
    autograd thinks, and tensors made under inference_mode are written under it,
    wherever the wait happens; entering either guard costs microseconds, so only
    where a tensor needs it (as torch's profiler range, only while it records).
    """
    start = time.perf_counter()
    if divisor == 1 and not divided and len(restores) == 1 and not _profiler_enabled():
        buffer, targets, starts = restores[0]  # the common case: one buffer into one plain tensor, no guard
        if len(targets) == 1 and starts is None and not targets[0].requires_grad and not targets[0].is_inference():
            _write_back(buffer, targets, starts)
            return time.perf_counter() - start
    written = [t for _, targets, _ in restores for t in targets] + divided
    if any(t.is_inference() for t in written):
        guard: ContextManager[Any] = torch.inference_mode()
    elif any(t.requires_grad for t in written):
        guard = torch.no_grad()
    else:
        guard = _UNTRACED
    with guard, _traced("comm.write_back"):
        if divisor != 1:
            for tensor in divided + [buffer for buffer, _, _ in restores]:
                tensor.div_(divisor)
        for buffer, targets, starts in restores:
            _write_back(buffer, targets, starts)
    return time.perf_counter() - start


def _write_back(buffer: torch.Tensor, targets: List[torch.Tensor], starts: Optional[List[int]]) -> None:
    """Copy ``buffer`` into ``targets``: one transfer, then views of host memory where there are several."""
    if len(targets) == 1 and starts is None:
        target = targets[0]  # one copy; a view of device memory only for a flat buffer
        target.copy_(buffer if buffer.shape == target.shape else buffer.view(target.shape))
        return
    flat = buffer if buffer.device == targets[0].device else buffer.to(targets[0].device)
    if starts is None:
        starts = [0]
        for tensor in targets[:-1]:
            starts.append(starts[-1] + tensor.numel())
    for tensor, begin in zip(targets, starts):
        tensor.copy_(flat[begin : begin + tensor.numel()].view(tensor.shape))


