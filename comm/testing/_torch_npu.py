"""A stand-in ``torch_npu`` module, provided by the simulated NPU once it runs.

Code that detects Ascend by importing ``torch_npu`` (Accelerate, transformers:
``importlib.util.find_spec("torch_npu")``, then ``import torch_npu`` and
``torch.npu.is_available()``) sees the simulated NPU as an Ascend machine. It is
installed only where no real ``torch_npu`` can be imported, and it carries a real
module spec (``find_spec`` returns it, as for any imported module).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

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
    module.__version__ = torch.__version__  # type: ignore[attr-defined]  # torch_npu's version follows torch's
    module.npu = torch.npu  # type: ignore[attr-defined]
    module.__comm_simulated__ = True  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = torch.npu  # type: ignore[attr-defined]
    return True
