"""torchtitan's Trainer on its llama3 debug model: FSDP2 over the ranks, parameters offloaded to the CPU.

    torchrun --nproc-per-node 2 torchtitan_llama.py

This is what ``torchtitan.train`` does: a ``JobConfig`` parsed by torchtitan's
``ConfigManager`` from command-line style arguments, then ``Trainer(config).train()``.
The model is the "debugmodel" flavour of torchtitan's llama3 (dim 256, 6 layers,
vocabulary 2048); the job shards it over the ranks with FSDP2
(``parallelism.data_parallel_shard_degree``) and offloads parameters, gradients and
optimizer state to the CPU (``training.enable_cpu_offload``), for 3 steps of 2 sequences
of 128 tokens per rank. The Trainer then does all the rest itself: it picks the device
(``torchtitan.tools.utils.device_type``) and the process group's backend, builds the
model on the meta device, applies ``parallelize_llama``, materialises the parameters
with ``to_empty`` and ``init_weights(buffer_device=...)`` (which builds the RoPE cache
under ``with torch.device(buffer_device)``), clips with its ``clip_grad_norm_`` and steps
its AdamW.

Nothing is downloaded: the tokenizer (word-level, 64 words) and the text (seeded random
words) are made at run time, and the text reaches the Trainer through torchtitan's own
Hugging Face text dataloader. Every rank prints each step's loss (torchtitan's global
average over the ranks), the gradient norm before clipping, and the device and backend
torchtitan chose.
"""

import dataclasses
import json
import os
import random
import sys
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import ConfigManager
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
from torchtitan.tools import utils
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer

STEPS = 3
SEQUENCE = 128
BATCH = 2  # sequences per rank and step
WORDS = [f"w{i}" for i in range(61)]
BOS, EOS, UNKNOWN = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def write_tokenizer(folder: str) -> None:
    """A word-level tokenizer over WORDS, saved where torchtitan's HuggingFaceTokenizer looks for one."""
    vocabulary = {token: index for index, token in enumerate([UNKNOWN, BOS, EOS, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as file:
        json.dump({"bos_token": BOS, "eos_token": EOS}, file)


def texts() -> list:
    """Seeded documents of random words, more than the steps of both ranks use."""
    generator = random.Random(1234)
    return [" ".join(generator.choices(WORDS, k=generator.randint(20, 200))) for _ in range(64)]


# torchtitan's text dataloader reads datasets by name from DATASETS; this one is made
# in memory instead of loaded from a path.
DATASETS["synthetic"] = DatasetConfig(
    path="",
    loader=lambda path: Dataset.from_dict({"text": texts()}),
    sample_processor=lambda sample: sample["text"],
)


class Report(MetricsProcessor):
    """torchtitan's metrics processor, also printing each logged step as the client tier reads it."""

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        rank = torch.distributed.get_rank()
        device = torch.device(utils.device_type, utils.device_module.current_device())
        # One write per line, so that the ranks' lines do not interleave.
        sys.stdout.write(f"rank {rank}: step {step} loss {global_avg_loss:.8f} grad_norm {grad_norm:.8f} "
                         f"on {device} ({torch.distributed.get_backend()})\n")
        sys.stdout.flush()
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


def build_report(job_config, parallel_dims, model_args=None, tag=None) -> Report:
    """Builds the metrics processor, as torchtitan's build_metrics_processor does."""
    return Report(job_config, parallel_dims, tag)


# torchtitan's llama3 train spec (model, parallelize_llama, build_optimizers, text
# dataloader, tokenizer, loss), with the metrics processor above.
register_train_spec("llama3_client", dataclasses.replace(get_train_spec("llama3"),
                                                         build_metrics_processor_fn=build_report))


def arguments(folder: str) -> list:
    """The job, as one would pass it to torchtitan's train.py."""
    return [
        "--model.name", "llama3_client",
        "--model.flavor", "debugmodel",
        "--model.hf_assets_path", folder,
        "--job.dump_folder", folder,
        "--training.dataset", "synthetic",
        "--training.steps", str(STEPS),
        "--training.seq_len", str(SEQUENCE),
        "--training.local_batch_size", str(BATCH),
        "--training.enable_cpu_offload",
        "--training.mixed_precision_param", "float32",  # no bfloat16 rounding in the numbers compared
        "--parallelism.data_parallel_shard_degree", os.environ["WORLD_SIZE"],
        "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "1",
        "--debug.seed", "0",
    ]


def main() -> None:
    init_logger()
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer(folder)
        trainer = Trainer(ConfigManager().parse_args(arguments(folder)))
        try:
            trainer.train()
        finally:
            trainer.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
