"""Staging: where a tensor must go for a group's backend to accept it.

A collective on a group whose backend does not serve the tensor's device (a CPU
gradient norm on an nccl or hccl group) fails in torch. ``staging_device`` names the
device to move it to; the collective wrappers do the moving.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, FrozenSet, List, Optional, Sequence

import torch
import torch.distributed as dist

from comm.backend import _resolve_group, device_types
from comm.device import _is_available, accelerator_type, current_device

__all__ = ["staging_device"]


def staging_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> Optional[torch.device]:
    """The device ``tensor`` must be staged onto for ``group``, or None if it is served natively.

    The target is the group's bound device (``init_process_group(device_id=...)``)
    if any, else this process's current device of a device type the backend serves
    (the bound local rank), else the CPU for a CPU backend.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    group = _resolve_group(group)
    served = device_types(group)
    if tensor.device.type in served:
        return None
    return _staging_target(group, served)


def _staging_target(group: dist.ProcessGroup, served: FrozenSet[str]) -> torch.device:
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound.type in served:
        return torch.device(bound)
    accelerator = accelerator_type()
    if accelerator in served:
        return current_device(accelerator)
    for device_type in sorted(served - {"cpu"}):
        if _is_available(device_type):
            return current_device(device_type)
    if "cpu" in served:
        return torch.device("cpu")
    raise RuntimeError(
        f"the group's backend serves device types {sorted(served)}, none of which is available in this process"
    )


def stage(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat copy of ``tensors`` (one dtype) on ``device``: a single transfer.

    Always a copy, never a view of the caller's memory, so a failed collective
    cannot touch the caller's tensors.
    """
    if len(tensors) == 1:
        source = tensors[0].reshape(-1)
    else:
        source = torch.cat([t.reshape(-1) for t in tensors])
    return source.to(device, copy=True)


def restore(flat: torch.Tensor, tensors: Sequence[torch.Tensor], starts: Optional[Sequence[int]] = None) -> None:
    """Write consecutive pieces of ``flat`` back into ``tensors`` in place.

    Piece ``i`` starts at ``starts[i]`` (packed back to back by default). The
    caller's tensors keep their identity, device, dtype, shape and strides.
    """
    if not tensors:
        return
    if len(tensors) > 1 and flat.device != tensors[0].device:
        flat = flat.to(tensors[0].device)  # one transfer back, then host-side copies
    if starts is None:
        starts = _packed_starts(tensors)
    with torch.no_grad():  # like c10d, write results in place whatever autograd thinks
        for tensor, start in zip(tensors, starts):
            tensor.copy_(flat[start : start + tensor.numel()].view(tensor.shape))


def _packed_starts(tensors: Sequence[torch.Tensor]) -> List[int]:
    starts, offset = [], 0
    for tensor in tensors:
        starts.append(offset)
        offset += tensor.numel()
    return starts


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (shown in the traceback from Python 3.11)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]


class DeferredWork:
    """The work handle of a collective ``comm`` must finish: copy back, divide for AVG.

    Behaves like torch's work object: ``wait()`` waits and then writes the results
    into the caller's tensors; ``is_completed()`` is True only once they are
    there; ``get_future()`` completes after the write-back.

    It must hold no reference to the process group: ``get_future()``'s callback
    runs on a backend thread, and if that thread dropped the group's last
    reference, the group's destructor would join the thread it runs on (gloo
    aborts with "Resource deadlock avoided").
    """

    def __init__(self, works: Sequence[Any], finish: Callable[[], None], outputs: List[torch.Tensor],
                 note: str) -> None:
        self._works = list(works)
        self._finish = finish
        self._outputs = outputs
        self._note = note
        self._lock = threading.Lock()
        self._finished = False

    def wait(self, timeout: Optional[Any] = None) -> bool:
        try:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
        except BaseException as error:
            if self._note:
                add_note(error, self._note)
            raise
        self._finish_once()
        return True

    def is_completed(self) -> bool:
        if not all(work.is_completed() for work in self._works):
            return False
        if all(work.is_success() for work in self._works):
            self._finish_once()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and all(work.is_success() for work in self._works)

    def exception(self) -> Optional[BaseException]:
        for work in self._works:
            error: Optional[BaseException] = work.exception()
            if error is not None:
                return error
        return None

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future[List[torch.Tensor]]:
        inner = torch.futures.collect_all([work.get_future() for work in self._works])
        return inner.then(self._finish_future)

    def _finish_future(self, done: torch.futures.Future[List[torch.futures.Future[Any]]]) -> List[torch.Tensor]:
        for future in done.value():
            future.value()  # re-raises the collective's error
        self._finish_once()
        return self._outputs

    def _finish_once(self) -> None:
        with self._lock:
            if not self._finished:
                self._finish()
                self._finished = True
