"""What differs between the torch releases comm supports (2.9 to 2.15), in one place.

Each function answers one question whose answer, or whose way of asking, a release
changed; the rest of comm asks here. The C++ counterpart is ``csrc/torch_releases.h``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

# This torch's release as (major, minor).
TORCH_VERSION: Tuple[int, ...] = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def backend_options(backend: Any) -> Optional[Any]:
    """A c10d backend's options (its timeout among them), or None where it keeps none.

    Torch 2.14 gave every ``Backend`` an ``options`` property that raises for backends
    that do not implement ``getBackendOptions`` (plugins such as hccl); before, only
    nccl's and gloo's had the attribute.
    """
    try:
        return getattr(backend, "options", None)
    except RuntimeError:
        return None


def flat_gather() -> Callable[..., Any]:
    """torch's all-gather into one flat tensor: ``all_gather_single`` from 2.12, which deprecates
    ``all_gather_into_tensor`` in its favour; ``all_gather_into_tensor`` before."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
