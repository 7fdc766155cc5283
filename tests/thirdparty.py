"""Stands in for a library (torchmetrics, DeepSpeed) that calls torch.distributed itself."""

import torch
import torch.distributed


def sum_metric(value: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(value)  # looked up at call time, as libraries do
    return value
