"""comm's explicit collectives and point-to-point calls: torch.distributed's, on any device.

Each ``comm.<name>`` has exactly torch's signature and return value, and calls
torch's own function once the group is equipped with comm's staging backend
(:mod:`comm.slot`), which c10d then hands the tensors of unserved devices to.
What they add to torch's: the group is equipped at its first call, so code that
created it without comm still stages; ``ReduceOp.AVG`` runs as SUM then divide
where the group's backend lacks it (:mod:`comm.gaps`); ``all_gather`` takes
pieces of unequal sizes on every backend; and where the staging backend cannot
be built, they stage in plain Python (:mod:`comm.fallback`), as they do a call whose
tensors lie on different devices (an NPU input gathered into CPU outputs), which
c10d hands whole to the backend of the input's device.

:data:`COLLECTIVES` describes each call once: the arguments it reads and those it
writes. Everything else about a call is torch's.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, NamedTuple, Tuple

import torch
import torch.distributed as dist

from comm import fallback, gaps, slot


class Collective(NamedTuple):
    """What a call does with its tensors: the arguments (by torch's parameter names) it reads and writes."""

    reads: Tuple[str, ...]
    writes: Tuple[str, ...]

    @property
    def mixes(self) -> bool:
        """Whether its tensors come in more than one argument, so that they may lie on different devices."""
        return len({*self.reads, *self.writes}) > 1


COLLECTIVES: Dict[str, Collective] = {
    "all_reduce": Collective(("tensor",), ("tensor",)),
    "all_reduce_coalesced": Collective(("tensors",), ("tensors",)),
    "broadcast": Collective(("tensor",), ("tensor",)),
    "reduce": Collective(("tensor",), ("tensor",)),
    "all_gather": Collective(("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": Collective(("input_tensor",), ("output_tensor",)),
    "all_gather_single": Collective(("input_tensor",), ("output_tensor",)),
    "all_gather_coalesced": Collective(("input_tensor_list",), ("output_tensor_lists",)),
    "reduce_scatter": Collective(("input_list",), ("output",)),
    "reduce_scatter_tensor": Collective(("input",), ("output",)),
    "reduce_scatter_single": Collective(("input",), ("output",)),
    "gather": Collective(("tensor",), ("gather_list",)),
    "scatter": Collective(("scatter_list",), ("tensor",)),
    "all_to_all": Collective(("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": Collective(("input",), ("output",)),
    "barrier": Collective((), ()),
    "send": Collective(("tensor",), ()),
    "isend": Collective(("tensor",), ()),
    "recv": Collective((), ("tensor",)),
    "irecv": Collective((), ("tensor",)),
    "batch_isend_irecv": Collective((), ()),
}
# torch.distributed's own function for each, captured at import. Where this torch
# lacks the *_single names (before 2.12), their older names stand in.
_OLDER_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
TORCH: Dict[str, Callable[..., Any]] = {
    name: getattr(dist, name, None) or getattr(dist, _OLDER_NAMES.get(name, name)) for name in COLLECTIVES
}


def _explicit(name: str) -> Callable[..., Any]:
    """comm's ``name``: torch's function, once the group it runs on is equipped, with comm's additions.

    torch's function is read from :data:`TORCH` on every call: comm.profile() puts
    a timed one there while it is open.
    """
    gap = gaps.GAPS.get(name)
    collective = COLLECTIVES[name]

    @functools.wraps(TORCH[name])
    def explicit(*args: Any, **kwargs: Any) -> Any:
        torch_call = TORCH[name]
        if torch.compiler.is_compiling():
            return torch_call(*args, **kwargs)  # dynamo turns it into a functional collective
        call = torch_call if gap is None else functools.partial(_fill, gap, torch_call)
        if slot.ready(fallback.group_of(name, torch_call, args, kwargs)) and not (
                collective.mixes and fallback.mixes_devices(args, kwargs)):
            return call(*args, **kwargs)
        return fallback.run(name, collective, torch_call, call, args, kwargs)

    explicit.__module__ = __name__
    explicit.__comm_name__ = name  # type: ignore[attr-defined]
    # torch's signature for help() and inspect, without __wrapped__: dynamo would take
    # the wrapper for torch's own function and not trace into it.
    explicit.__signature__ = inspect.signature(TORCH[name])  # type: ignore[attr-defined]
    del explicit.__wrapped__
    return explicit


def _fill(gap: gaps.Gap, torch_call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return gap(torch_call, args, kwargs)


def _torch_op(op: Any) -> Any:
    """torch's isend or irecv (as torch.distributed holds it now) for comm's; any other op as it is.

    Told apart by the name each of comm's calls carries: dynamo cannot tell comm's
    wrappers apart by identity (they share one code object).
    """
    name = getattr(op, "__comm_name__", None)
    return op if name is None else getattr(dist, name)


def P2POp(op: Any, *args: Any, **kwargs: Any) -> dist.P2POp:  # noqa: N802 - torch's name for what it builds
    """torch's ``P2POp`` (its arguments), also built with ``comm.isend`` or ``comm.irecv``."""
    return dist.P2POp(_torch_op(op), *args, **kwargs)


all_reduce = _explicit("all_reduce")
all_reduce_coalesced = _explicit("all_reduce_coalesced")
broadcast = _explicit("broadcast")
reduce = _explicit("reduce")
all_gather = _explicit("all_gather")
all_gather_into_tensor = _explicit("all_gather_into_tensor")
all_gather_single = _explicit("all_gather_single")
all_gather_coalesced = _explicit("all_gather_coalesced")
reduce_scatter = _explicit("reduce_scatter")
reduce_scatter_tensor = _explicit("reduce_scatter_tensor")
reduce_scatter_single = _explicit("reduce_scatter_single")
gather = _explicit("gather")
scatter = _explicit("scatter")
all_to_all = _explicit("all_to_all")
all_to_all_single = _explicit("all_to_all_single")
barrier = _explicit("barrier")
send = _explicit("send")
isend = _explicit("isend")
recv = _explicit("recv")
irecv = _explicit("irecv")
batch_isend_irecv = _explicit("batch_isend_irecv")

__all__ = ["COLLECTIVES", "P2POp", *COLLECTIVES]
