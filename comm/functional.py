"""Functional collectives under the patch: DTensor's collectives on tensors the group does not serve.

DTensor (FSDP2, tensor parallel, ``full_tensor()``, redistribution) and compiled
graphs call the functional collectives, the ``torch.ops._c10d_functional`` ops,
not ``torch.distributed.all_reduce``. Each has one kernel for every device, which
asks the group for a backend of the tensor's device: CPU shards left by FSDP2's
CPU offload on an nccl or hccl mesh fail there with the second seed's error.

While patched, comm registers a kernel for these ops on the CPU dispatch key. It
hands a call whose group serves the CPU back to torch's own kernel, and runs any
other through comm's c10d collectives, which stage onto the group's device and
back with the same engine as every comm call: the result lives on the CPU, and
``wait_tensor`` (and so ``AsyncCollectiveTensor``) waits for the write-back.

A Python kernel costs several microseconds per call, even when it only hands the
call back, so the kernels are registered only while the process holds a group
whose backend does not serve the CPU: in a gloo-only process every functional
collective takes torch's path untouched, and accelerator tensors never reach a
CPU kernel. Only the functional collectives on CPU tensors are covered: an
accelerator tensor on a group that does not serve its device still fails.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed._functional_collectives import REDUCE_OP_TO_STR

from comm import collectives, exchange
from comm.backend import _group_info, _served_types

# The reduce ops by the names the functional collectives' schemas give them: torch's table, inverted.
_REDUCE_OPS = {name: op for op, name in REDUCE_OP_TO_STR.items()}
# Redispatching with no backend key reaches the kernel torch registered as CompositeExplicitAutograd
# (alias keys cannot be in a key set: this set is empty, and that kernel also fills the empty slot).
_TORCHS_OWN_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
_OPS = torch.ops._c10d_functional
_LOCK = threading.Lock()
_library: Optional[Any] = None  # the torch.library registration, while it exists


def needed(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s backend leaves CPU tensors to comm (it does not serve the CPU).

    Asked while c10d creates the group, before it records the group's ranks.
    """
    return "cpu" not in _served_types(group)


def register() -> None:
    """Register comm's CPU kernels for the functional collectives (idempotent)."""
    global _library
    with _LOCK:
        if _library is not None:
            return
        library = torch.library.Library("_c10d_functional", "IMPL")  # type: ignore[no-untyped-call]
        for name, kernel in _KERNELS.items():
            library.impl(name, kernel, "CPU")  # type: ignore[no-untyped-call]
        _library = library


def unregister() -> None:
    """Remove comm's kernels: torch's own kernel serves every call again."""
    global _library
    with _LOCK:
        if _library is not None:
            _library._destroy()
            _library = None


def is_registered() -> bool:
    """Whether comm's kernels are registered now (the patch registers them only where a group needs them)."""
    return _library is not None


def _group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)  # type: ignore[attr-defined]


def _reduce_op(name: str) -> Any:
    op = _REDUCE_OPS.get(name.lower())
    if op is None:
        raise ValueError(f"reduce_op {name!r} is not one comm stages; expected one of {sorted(_REDUCE_OPS)}")
    return op


def _await(tensors: Sequence[torch.Tensor], work: Any) -> None:
    """Make ``wait_tensor`` on each of ``tensors`` wait for ``work`` (comm's handle: with the write-back).

    The handle itself, not a work built from its future: c10d's future-built work
    does not raise its future's error on ``wait()``, and a failed collective must.
    """
    for tensor in tensors:
        torch._C._distributed_c10d._register_work(tensor, work)


def _kernel(op: Any, staged: Callable[..., Any]) -> Callable[..., Any]:
    """A CPU kernel for ``op``: torch's own kernel where the group serves the CPU, else ``staged``.

    ``staged(pg, *args, **kwargs)`` starts comm's collective and returns the op's
    outputs, each with its work registered for ``wait_tensor``.
    """
    group_at = [argument.name for argument in op._schema.arguments].index("group_name")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        pg = _group(args[group_at])
        if _group_info(pg).serves_cpu:  # cached per group: needed()'s answer, without asking c10d each call
            return op.redispatch(_TORCHS_OWN_KERNEL, *args, **kwargs)
        return staged(pg, *args, **kwargs)

    return kernel


def _reduced(pg: dist.ProcessGroup, outputs: List[torch.Tensor], reduce_op: str) -> List[torch.Tensor]:
    """All-reduce ``outputs`` in place, one collective per device and dtype; wait_tensor waits for it."""
    _await(outputs, collectives.all_reduce_coalesced(outputs, _reduce_op(reduce_op), pg, async_op=True))
    return outputs


def _gathered(pg: dist.ProcessGroup, outputs: List[torch.Tensor], inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    for output, tensor in zip(outputs, inputs):
        _await([output], collectives.all_gather_into_tensor(output, tensor, pg, async_op=True))
    return outputs


def _scattered(pg: dist.ProcessGroup, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
               reduce_op: str) -> List[torch.Tensor]:
    for output, tensor in zip(outputs, inputs):
        _await([output], collectives.reduce_scatter_tensor(output, tensor, _reduce_op(reduce_op), pg, async_op=True))
    return outputs


def _new(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` laid out as torch's functional collectives return theirs: contiguous."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _gathered_like(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    return tensor.new_empty((tensor.size(0) * group_size, *tensor.shape[1:]))


def _scattered_like(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    return tensor.new_empty((tensor.size(0) // group_size, *tensor.shape[1:]))


# comm's form of each op: its arguments after the group, in the op's order.
def _all_reduce(pg: dist.ProcessGroup, input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    return _reduced(pg, [_new(input)], reduce_op)[0]


def _all_reduce_(pg: dist.ProcessGroup, input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    return _reduced(pg, [input], reduce_op)[0]


def _all_reduce_coalesced(pg: dist.ProcessGroup, inputs: List[torch.Tensor], reduce_op: str,
                          group_name: Any) -> List[torch.Tensor]:
    return _reduced(pg, [_new(t) for t in inputs], reduce_op)


def _all_reduce_coalesced_(pg: dist.ProcessGroup, inputs: List[torch.Tensor], reduce_op: str,
                           group_name: Any) -> List[torch.Tensor]:
    return _reduced(pg, list(inputs), reduce_op)


def _all_gather_into_tensor(pg: dist.ProcessGroup, input: torch.Tensor, group_size: int,
                            group_name: Any) -> torch.Tensor:
    return _gathered(pg, [_gathered_like(input, group_size)], [input])[0]


def _all_gather_into_tensor_out(pg: dist.ProcessGroup, input: torch.Tensor, group_size: int, group_name: Any, *,
                                out: torch.Tensor) -> torch.Tensor:
    return _gathered(pg, [out], [input])[0]


def _all_gather_into_tensor_coalesced(pg: dist.ProcessGroup, inputs: List[torch.Tensor], group_size: int,
                                      group_name: Any) -> List[torch.Tensor]:
    return _gathered(pg, [_gathered_like(t, group_size) for t in inputs], list(inputs))


def _reduce_scatter_tensor(pg: dist.ProcessGroup, input: torch.Tensor, reduce_op: str, group_size: int,
                           group_name: Any) -> torch.Tensor:
    return _scattered(pg, [_scattered_like(input, group_size)], [input], reduce_op)[0]


def _reduce_scatter_tensor_out(pg: dist.ProcessGroup, input: torch.Tensor, reduce_op: str, group_size: int,
                               group_name: Any, *, out: torch.Tensor) -> torch.Tensor:
    return _scattered(pg, [out], [input], reduce_op)[0]


def _reduce_scatter_tensor_coalesced(pg: dist.ProcessGroup, inputs: List[torch.Tensor], reduce_op: str,
                                     group_size: int, group_name: Any) -> List[torch.Tensor]:
    return _scattered(pg, [_scattered_like(t, group_size) for t in inputs], list(inputs), reduce_op)


def _all_to_all_single(pg: dist.ProcessGroup, input: torch.Tensor, output_split_sizes: List[int],
                       input_split_sizes: List[int], group_name: Any) -> torch.Tensor:
    output = input.new_empty((sum(output_split_sizes), *input.shape[1:]))
    work = exchange.all_to_all_single(output, input, list(output_split_sizes), list(input_split_sizes), pg,
                                      async_op=True)
    _await([output], work)
    return output


def _broadcast(pg: dist.ProcessGroup, input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    return _broadcast_(pg, _new(input), src, group_name)


def _broadcast_(pg: dist.ProcessGroup, input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    _await([input], collectives.broadcast(input, group=pg, async_op=True, group_src=src))  # src: a group rank
    return input


# comm's form of each op, named for it ("_all_reduce_" for all_reduce_); ops this torch lacks are left out.
_KERNELS = {
    staged.__name__[1:]: _kernel(getattr(_OPS, staged.__name__[1:]).default, staged)
    for staged in (_all_reduce, _all_reduce_, _all_reduce_coalesced, _all_reduce_coalesced_, _all_gather_into_tensor,
                   _all_gather_into_tensor_out, _all_gather_into_tensor_coalesced, _reduce_scatter_tensor,
                   _reduce_scatter_tensor_out, _reduce_scatter_tensor_coalesced, _all_to_all_single, _broadcast,
                   _broadcast_)
    if hasattr(_OPS, staged.__name__[1:])
}
