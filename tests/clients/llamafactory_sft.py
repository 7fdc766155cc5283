"""LLaMA-Factory's supervised fine-tuning (``stage: sft``, full) of a tiny Llama: FSDP2 with CPU offload, clipping.

    torchrun --nproc-per-node 2 llamafactory_sft.py

LLaMA-Factory's ``run_exp`` with the arguments a user's ``train.yaml`` holds (``llamafactory-cli
train`` would start a torchrun of its own on a machine with two devices). Nothing is downloaded:
each rank saves a tiny Llama built from a config with seeded weights and a character-level
tokenizer made here, and writes an Alpaca-format dataset with its ``dataset_info.json``, in a
temporary folder. FSDP2 comes from Accelerate's ``FSDP_VERSION=2``, what ``accelerate launch``
exports for a config with ``fsdp_version: 2`` (transformers 4.52's ``fsdp_config`` has no
version). Every rank prints each logged step's loss and gradient norm and the device Trainer chose.
"""

import json
import os
import tempfile
from pathlib import Path

import torch
from llamafactory.train.tuner import run_exp
from tiny_sft import STEPS, pairs, report, save_tiny_llama
from transformers import TrainerCallback


class Report(TrainerCallback):
    """Prints each logged step (tiny_sft.report)."""

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        report(args, state, logs, model)


def write_dataset(folder: Path) -> None:
    """Alpaca-format pairs from a seeded generator, and the dataset_info.json that names them."""
    samples = [{"instruction": question, "input": "", "output": answer} for question, answer in pairs()]
    (folder / "tiny.json").write_text(json.dumps(samples))
    (folder / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))


def arguments(folder: Path) -> dict:
    """A user's train.yaml: full SFT, FSDP2 sharding each decoder layer with its parameters on the CPU, clip at 1.0."""
    return {
        "model_name_or_path": str(folder / "model"), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "tiny", "dataset_dir": str(folder / "data"), "template": "default", "cutoff_len": 64,
        "overwrite_cache": True, "cache_dir": str(folder / "cache"), "preprocessing_num_workers": None,
        "disable_gradient_checkpointing": True,
        "output_dir": str(folder / "output"), "overwrite_output_dir": True, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "disable_tqdm": True, "plot_loss": False,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": STEPS,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "max_grad_norm": 1.0,
        "seed": 0, "data_seed": 0, "dataloader_num_workers": 0,
        "use_cpu": not torch.accelerator.is_available(),  # a CPU-only machine: Accelerate's gloo
        "fsdp": "full_shard offload auto_wrap", "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    }


def main() -> None:
    os.environ.setdefault("FSDP_VERSION", "2")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        # Saved in float16, as checkpoints on a hub are: LLaMA-Factory loads a model in float16 where an
        # accelerator is available (infer_optim_dtype) and in float32 on a CPU-only machine, then trains a
        # full fine-tuning in float32; float16 weights are the same either way.
        save_tiny_llama(folder / "model", torch.float16)
        (folder / "data").mkdir()
        write_dataset(folder / "data")
        run_exp(arguments(folder), callbacks=[Report()])


if __name__ == "__main__":
    main()
