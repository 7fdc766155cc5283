"""A stand-in ``torch_npu`` module, provided by the simulated NPU once it runs.

Code that detects Ascend by importing ``torch_npu`` (Accelerate, transformers:
``importlib.util.find_spec("torch_npu")``, then ``import torch_npu`` and
``torch.npu.is_available()``) sees the simulated NPU as an Ascend machine. It is
installed only where no real ``torch_npu`` can be imported, and it carries a real
module spec (``find_spec`` returns it, as for any imported module), a ``__file__``
(DeepSpeed's op builders look beside it), ``npu_fusion_attention`` and
``npu_rotary_mul`` (transformers imports both where torch_npu is present) and, as
CANN's ``set_env.sh`` does, ``ASCEND_HOME_PATH`` (DeepSpeed reads it).

:func:`apply_patches` (opt-in) also replaces in torch what real torch_npu replaces
at import, as it does: its own objects where torch's were, not wrappers of whatever
stands there (comm's stand-ins included).
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["apply_patches", "install"]

_LOCK = threading.Lock()
_applied = False


def install() -> bool:
    """Put the stand-in in ``sys.modules`` unless a real ``torch_npu`` is importable; return whether it did."""
    if "torch_npu" in sys.modules:
        return False
    if importlib.util.find_spec("torch_npu") is not None:
        return False
    module = types.ModuleType("torch_npu", "Stand-in for Ascend's torch_npu, provided by comm.testing's simulated NPU.")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, origin="comm.testing (simulated NPU)")
    module.__file__ = __file__  # a file that exists, as an installed package's __init__.py does
    module.__version__ = torch.__version__  # type: ignore[attr-defined]  # torch_npu's version follows torch's
    module.npu = torch.npu  # type: ignore[attr-defined]
    module.npu_fusion_attention = npu_fusion_attention  # type: ignore[attr-defined]
    module.npu_rotary_mul = npu_rotary_mul  # type: ignore[attr-defined]
    module.Format = Format  # type: ignore[attr-defined]
    module.get_npu_format = get_npu_format  # type: ignore[attr-defined]
    module.npu_format_cast = npu_format_cast  # type: ignore[attr-defined]
    module.npu_format_cast_ = npu_format_cast_  # type: ignore[attr-defined]
    module.distributed = _distributed_module()  # type: ignore[attr-defined]
    module.__comm_simulated__ = True  # type: ignore[attr-defined]
    for name, switches in (("config", _Switches("allow_internal_format")), ("matmul", _Switches("allow_hf32")),
                           ("conv", _Switches("allow_hf32"))):
        setattr(torch.npu, name, switches)  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = torch.npu  # type: ignore[attr-defined]
    sys.modules["torch_npu.npu.amp"] = torch.npu.amp  # type: ignore[attr-defined]
    sys.modules["torch_npu.distributed"] = module.distributed
    # CANN's set_env.sh exports the toolkit's folder; this one exists (the simulated toolkit has nothing in it).
    os.environ.setdefault("ASCEND_HOME_PATH", os.path.dirname(__file__))
    return True


def apply_patches() -> None:
    """Replace in torch what torch_npu 2.13.0 replaces at import, as it does; once per process.

    Real torch_npu does this inside ``import torch`` (autoload), so before comm, or at
    a later ``import torch_npu`` where ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so possibly
    after ``comm.patch()``: call this where the test needs it. Each object put in
    place is a function of its own that calls torch's function (found under any
    stand-in that names what it wraps, as ``functools.wraps`` does), never the stand-in:
    what was in place is lost, as with the real one. What is replaced, with where
    torch_npu does it (Ascend/pytorch, the torch_npu 2.13.0 and 2.9.1 wheels' Python sources):

    * ``distributed_c10d._new_process_group_helper``: a full copy of torch's
      (2.13 ``_compat/distributed.py:205-529``; 2.9.1 ``distributed/distributed_c10d.py:409-711``);
    * ``gather`` in ``torch.distributed`` and ``distributed_c10d``: one without ``group_dst``
      (2.13 ``distributed/distributed_c10d.py:137``, aliased at ``_init/patches/distributed_patches.py:19-56``);
    * ``batch_isend_irecv`` and ``gather_object`` there too (the same lines): CPU tensors' ops issued one
      by one, with no coalescing manager;
    * ``torch.nn.Module.to`` (2.13 ``utils/_module.py:285``) and ``torch.load`` (``utils/serialization.py:661``).
    """
    global _applied
    with _LOCK:
        if _applied:
            return
        for owner, name, value in _patches():
            setattr(owner, name, value)
        _applied = True


def _torchs(function: Callable[..., Any]) -> Callable[..., Any]:
    """torch's own function under any stand-ins (comm's, a profile's) that name what they wrap."""
    unwrapped: Callable[..., Any] = inspect.unwrap(function)
    return unwrapped


def _patches() -> List[Tuple[Any, str, Any]]:
    """torch_npu's objects, each calling torch's own function as it stands now."""
    c10d = dist.distributed_c10d
    helper = _torchs(c10d._new_process_group_helper)
    # A copy as torch_npu's is: torch's body (here its very code) in a function object of its own.
    copy = types.FunctionType(helper.__code__, helper.__globals__, helper.__name__, helper.__defaults__,
                              helper.__closure__)
    copy.__kwdefaults__, copy.__doc__ = helper.__kwdefaults__, helper.__doc__
    copy.__module__ = "torch_npu._compat.distributed"
    torch_gather, torch_all_gather_object = _torchs(c10d.gather), _torchs(c10d.all_gather_object)
    torch_batch, torch_module_to, torch_load = _torchs(c10d.batch_isend_irecv), _torchs(torch.nn.Module.to), \
        _torchs(torch.load)

    def _gather(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: int = 0,
                group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Any:
        """torch_npu's gather: no ``group_dst`` (2.13 ``distributed/distributed_c10d.py:137``)."""
        return torch_gather(tensor, gather_list, dst, group, async_op)

    def _gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None, dst: int = 0,
                       group: Optional[dist.ProcessGroup] = None) -> None:
        """torch_npu's gather_object, which torch's cannot stand for: torch's calls ``gather`` with ``group_dst``.

        Here every rank gathers and ``dst`` keeps the list (the real one sends to ``dst`` only).
        """
        everyone: List[Any] = [None] * dist.get_world_size(group)
        torch_all_gather_object(everyone, obj, group)
        if object_gather_list is not None and dist.get_rank() == dst:
            object_gather_list[:] = everyone

    def _batch_isend_irecv(p2p_op_list: List[dist.P2POp]) -> Any:
        """CPU tensors: each op on its own, no coalescing manager (torch_npu's ``_batch_isend_irecv``)."""
        if p2p_op_list and p2p_op_list[0].tensor.device.type == "cpu":
            return [p2p.op(p2p.tensor, p2p.peer, p2p.group, p2p.tag) for p2p in p2p_op_list]
        return torch_batch(p2p_op_list)

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return torch_module_to(self, *args, **kwargs)

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        return torch_load(f, map_location, *args, **kwargs)

    found: List[Tuple[Any, str, Any]] = [(c10d, "_new_process_group_helper", copy)]
    for module in (dist, c10d):
        found += [(module, "gather", _gather), (module, "gather_object", _gather_object),
                  (module, "batch_isend_irecv", _batch_isend_irecv)]
    return found + [(torch.nn.Module, "to", to), (torch, "load", load)]


def _distributed_module() -> types.ModuleType:
    """``torch_npu.distributed``: what its ``__init__.py`` names (torch_npu 2.13.0 wheel).

    ``_make_hccl_premul_sum`` is torch's ``_make_nccl_premul_sum`` under another name there
    (``from torch.distributed import _make_nccl_premul_sum as _make_hccl_premul_sum``), so
    it is here; ``is_hccl_available`` answers for the simulated hccl backend.
    """
    module = types.ModuleType("torch_npu.distributed", "Stand-in for torch_npu.distributed (simulated NPU).")
    module._make_hccl_premul_sum = dist._make_nccl_premul_sum  # type: ignore[attr-defined]
    module.is_hccl_available = lambda: "hccl" in dist.Backend.backend_list  # type: ignore[attr-defined]
    module.is_available = dist.is_available  # type: ignore[attr-defined]
    return module


class _Switches:
    """``torch_npu.npu.config``, ``.matmul`` and ``.conv``: switches that a script sets and reads back.

    torch_npu's (``npu/npu_config.py``: ``_npuConfig``, ``_allowHF32Matmul``,
    ``_allowHF32Conv``) pass them to CANN; the simulated device has no internal formats
    and computes in the CPU's precision, so they change nothing here. ``allow_hf32`` must
    be a bool, as torch_npu checks.
    """

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "_values", {name: False for name in names})

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(name)
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "allow_hf32" and not isinstance(value, bool):
            raise TypeError(f"allow_hf32 must be a bool, but got {type(value).__name__}")
        object.__getattribute__(self, "_values")[name] = value


class Format(enum.IntEnum):
    """torch_npu's storage formats (``npu/_format.py``: ``Format``, ACL's numbers)."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47

    def __str__(self) -> str:
        return self.name


# The format each tensor was cast to, by the tensor's id, with a weak reference that tells a tensor
# gone from a new one under the same id (a WeakKeyDictionary would compare tensors with ==).
_FORMATS: Dict[int, Tuple["weakref.ref[torch.Tensor]", Format]] = {}


def _recorded(tensor: torch.Tensor) -> Optional[Format]:
    found = _FORMATS.get(id(tensor))
    return found[1] if found is not None and found[0]() is tensor else None


def _record(tensor: torch.Tensor, acl_format: Format) -> None:
    key = id(tensor)
    _FORMATS[key] = (weakref.ref(tensor, lambda _: _FORMATS.pop(key, None)), acl_format)


def get_npu_format(tensor: torch.Tensor) -> Format:
    """The storage format a tensor was cast to, else its base format: NCHW for 4 dimensions, ND otherwise.

    As torch_npu's ``InferFormat::GuessFormatUnit`` ("4 dim tensor must be NCHW"). The
    simulated device stores every tensor as the CPU does; only the name is kept.
    """
    recorded = _recorded(tensor)
    if recorded is not None:
        return recorded
    return Format.NCHW if tensor.dim() == 4 else Format.ND


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """``tensor`` in storage format ``acl_format``: its values, the format recorded (a new tensor, as torch_npu's)."""
    target = Format(int(acl_format))
    if get_npu_format(tensor) == target:
        return tensor
    cast = tensor.clone()
    _record(cast, target)
    return cast


def npu_format_cast_(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """In place: ``tensor`` keeps its values and is recorded in ``acl_format``."""
    _record(tensor, Format(int(acl_format)))
    return tensor


# npu_fusion_attention's layouts: where batch (B), heads (N), sequence (S) and head size (D) lie.
_LAYOUTS = ("BSND", "BNSD", "BSH", "SBH")


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,  # noqa: A002 - torch_npu's name
                   rotary_mode: str = "half") -> torch.Tensor:
    """torch_npu's fused rotary position embedding, in plain operators: ``input * r1 + rotate(input) * r2``.

    As Ascend's op-plugin documents it (docs/context/torch_npu-npu_rotary_mul.md):
    ``half`` rotates the two halves of the last dimension (``cat(-x2, x1)``),
    ``interleave`` its even and odd elements; other modes are refused.
    """
    if rotary_mode == "half":
        first, second = torch.chunk(input, 2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-input[..., 1::2], input[..., ::2]), dim=-1).flatten(-2)
    else:
        raise NotImplementedError(f"the simulated npu_rotary_mul takes rotary_mode 'half' or 'interleave', "
                                  f"got {rotary_mode!r}")
    return input * r1 + rotated * r2


def npu_fusion_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str,
    pse: Optional[torch.Tensor] = None, padding_mask: Optional[torch.Tensor] = None,
    atten_mask: Optional[torch.Tensor] = None, scale: float = 1.0, keep_prob: float = 1.0,
    pre_tockens: int = 2147483647, next_tockens: int = 2147483647, inner_precise: int = 0,
    prefix: Optional[torch.Tensor] = None, actual_seq_qlen: Optional[torch.Tensor] = None,
    actual_seq_kvlen: Optional[torch.Tensor] = None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
    sync: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """A reference of torch_npu's fused attention, in plain operators: its signature and output layout.

    Signature as torch_npu's ``npu_fusion_attention`` (torch_npu/_inductor/.../npu_stream.py
    wraps ``torch.ops.npu.npu_fusion_attention`` with it). ``atten_mask`` is True where a
    query must not attend (torch_npu's convention, the opposite of SDPA's);
    ``sparse_mode`` 2 and 3 are causal (aligned top-left and bottom-right), and the mask
    given with them only describes that. ``pse``, ``padding_mask``, the token windows,
    ``prefix`` and the variable-length ``TND`` layout are not simulated and are refused.
    Returns the attention in ``input_layout``, then the per-row softmax maximum and sum
    (shaped ``(B, N, Sq, 1)``, where the real kernel repeats them over 8 lanes), an
    empty softmax output, and seed, offset and mask size 0 (dropout draws from the CPU
    generator).
    """
    if input_layout not in _LAYOUTS:
        raise NotImplementedError(f"the simulated npu_fusion_attention takes layouts {_LAYOUTS}, got {input_layout!r}")
    unsupported = {"pse": pse, "padding_mask": padding_mask, "prefix": prefix, "actual_seq_qlen": actual_seq_qlen,
                   "actual_seq_kvlen": actual_seq_kvlen}
    given = [name for name, value in unsupported.items() if value is not None]
    if given or pre_tockens != 2147483647 or next_tockens != 2147483647 or sparse_mode not in (0, 1, 2, 3):
        raise NotImplementedError(f"the simulated npu_fusion_attention does not simulate {given or 'its windows'}")
    q, k, v = (_to_bnsd(tensor, input_layout, head_num) for tensor in (query, key, value))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    masked = _causal(scores, sparse_mode) if sparse_mode in (2, 3) else atten_mask
    if masked is not None:
        scores = scores.masked_fill(masked.to(torch.bool), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    weights = weights / row_sum
    if keep_prob < 1.0:
        weights = torch.nn.functional.dropout(weights, p=1.0 - keep_prob)
    out = _from_bnsd(torch.matmul(weights, v.float()).to(query.dtype), input_layout)
    return out, row_max, row_sum, query.new_empty(0), 0, 0, 0


def _to_bnsd(tensor: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BSND":
        return tensor.transpose(1, 2)
    if layout == "BNSD":
        return tensor
    if layout == "SBH":
        tensor = tensor.transpose(0, 1)
    batch, length, hidden = tensor.shape
    return tensor.reshape(batch, length, heads, hidden // heads).transpose(1, 2)


def _from_bnsd(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BSND":
        return tensor.transpose(1, 2)
    if layout == "BNSD":
        return tensor
    batch, heads, length, size = tensor.shape
    merged = tensor.transpose(1, 2).reshape(batch, length, heads * size)
    return merged.transpose(0, 1) if layout == "SBH" else merged


def _causal(scores: torch.Tensor, sparse_mode: int) -> torch.Tensor:
    """True above the diagonal: aligned at the top left (mode 2) or the bottom right (mode 3)."""
    queries, keys = scores.shape[-2], scores.shape[-1]
    shift = 1 if sparse_mode == 2 else keys - queries + 1
    return torch.ones(queries, keys, dtype=torch.bool, device=scores.device).triu(shift)
