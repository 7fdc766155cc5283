"""A stand-in ``torch_npu`` module, provided by the simulated NPU once it runs.

Code that detects Ascend by importing ``torch_npu`` (Accelerate, transformers:
``importlib.util.find_spec("torch_npu")``, then ``import torch_npu`` and
``torch.npu.is_available()``) sees the simulated NPU as an Ascend machine. It is
installed only where no real ``torch_npu`` can be imported, and it carries a real
module spec (``find_spec`` returns it, as for any imported module), a ``__file__``
(DeepSpeed's op builders look beside it), ``npu_fusion_attention`` (transformers'
attention on Ascend) and, as CANN's ``set_env.sh`` does, ``ASCEND_HOME_PATH``
(DeepSpeed reads it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Optional, Tuple

import torch

__all__ = ["install"]


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
    module.__comm_simulated__ = True  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = torch.npu  # type: ignore[attr-defined]
    sys.modules["torch_npu.npu.amp"] = torch.npu.amp  # type: ignore[attr-defined]
    # CANN's set_env.sh exports the toolkit's folder; this one exists (the simulated toolkit has nothing in it).
    os.environ.setdefault("ASCEND_HOME_PATH", os.path.dirname(__file__))
    return True


# npu_fusion_attention's layouts: where batch (B), heads (N), sequence (S) and head size (D) lie.
_LAYOUTS = ("BSND", "BNSD", "BSH", "SBH")


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
