"""Lightning DDP with ``sync_dist`` logging and a torchmetrics metric kept on the CPU (``compute_on_cpu``).

    torchrun --nproc-per-node 2 lightning_ddp.py [--accelerator auto|cuda|cpu]

Lightning picks the device and backend from ``--accelerator`` (its default, auto, as
most scripts leave it). Rank 0 prints each step's loss averaged over ranks by
``sync_dist``, with the device and backend torch ran it on, and, at the end, the
metric computed over both ranks' batches.
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

STEPS = 3
BATCH = 4  # per rank


def make_model() -> nn.Module:
    """A seeded two-layer MLP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def dataset() -> TensorDataset:
    """Seeded regression data: two ranks' batches for every step."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(STEPS * BATCH * 2, 16, generator=generator)
    return TensorDataset(inputs, inputs[:, :4].sum(dim=1, keepdim=True).tanh())


class Regression(L.LightningModule):
    """MSE regression, logging its loss with ``sync_dist`` and a mean absolute error computed on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()
        self.error = torchmetrics.MeanAbsoluteError(compute_on_cpu=True)

    def training_step(self, batch, index):
        inputs, targets = batch
        predictions = self.model(inputs)
        loss = nn.functional.mse_loss(predictions, targets)
        self.error.update(predictions.detach(), targets)
        self.log("loss", loss.detach().cpu(), sync_dist=True, on_step=True, prog_bar=False)
        return loss

    def on_train_batch_end(self, outputs, batch, index):
        if self.global_rank == 0:
            print(f"rank 0: step {index} loss {float(self.trainer.callback_metrics['loss']):.8f} "
                  f"on {self.where()}", flush=True)

    def where(self) -> str:
        """Where the step ran: the parameters' device and the group's backend, as torch has them.

        Not ``self.device`` and the strategy's backend name: those are what Lightning
        asked for (``cuda``, ``nccl`` on its CUDA path), not what torch gave it.
        """
        return f"{self.model[0].weight.device.type} ({torch.distributed.get_backend()})"

    def on_train_end(self):
        error = self.error.compute()
        if self.global_rank == 0:
            print(f"rank 0: mean absolute error {float(error):.8f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="auto")
    accelerator = parser.parse_args().accelerator
    trainer = L.Trainer(accelerator=accelerator, devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
