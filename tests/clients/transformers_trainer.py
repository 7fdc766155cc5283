"""transformers' Trainer on a tiny Llama built from a config: FSDP2 with CPU offload, clipping, token averaging.

    torchrun --nproc-per-node 2 transformers_trainer.py

Nothing is downloaded: the model comes from a ``LlamaConfig``, the data from a seeded
generator. Every rank prints each logged step's loss and gradient norm (Trainer
averages the loss over ranks; the norm is the global one) and the device Trainer chose.
"""

import os
import sys
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

STEPS = 3
SEQUENCE = 16
SAMPLES = 16


class Tokens(Dataset):
    """Seeded random token sequences, each its own label (causal LM)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (SAMPLES, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Report(TrainerCallback):
    """Prints each logged step's loss and gradient norm, one write per line so ranks do not interleave."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            rank = int(os.environ.get("RANK", "0"))
            sys.stdout.write(f"rank {rank}: step {state.global_step} loss {logs['loss']:.8f} "
                             f"grad_norm {float(logs['grad_norm']):.8f} on {args.device.type}\n")
            sys.stdout.flush()


def tiny_llama() -> LlamaForCausalLM:
    """Two layers, hidden size 32, vocabulary 64, with seeded initial weights."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE)
    return LlamaForCausalLM(config)


def arguments(output_dir: str) -> TrainingArguments:
    """FSDP2 sharding each decoder layer with its parameters offloaded to the CPU, clipped at 1.0."""
    return TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
        max_grad_norm=1.0, average_tokens_across_devices=True, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
        use_cpu=not torch.accelerator.is_available(),  # a CPU-only machine: Accelerate's gloo
        fsdp="full_shard offload auto_wrap",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(model=tiny_llama(), args=arguments(output_dir), train_dataset=Tokens(), callbacks=[Report()])
        trainer.train()


if __name__ == "__main__":
    main()
