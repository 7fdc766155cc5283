"""The workload the training clients share: a seeded MLP and seeded batches, so each framework's run
and its one-process reference see the same model and data."""

import torch
import torch.nn as nn

STEPS = 3
BATCH = 8  # over all ranks


def make_model() -> nn.Module:
    """A seeded two-layer MLP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(step: int) -> tuple:
    """The whole step's batch (every rank's), seeded by the step."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(BATCH, 16, generator=generator)
    return inputs, inputs[:, :4].sum(dim=1, keepdim=True).tanh()
