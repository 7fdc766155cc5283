"""ms-swift's supervised fine-tuning (``swift sft``, full) of a tiny Llama: FSDP2 with CPU offload, clipping.

    torchrun --nproc-per-node 2 swift_sft.py

ms-swift's ``sft_main`` (what ``swift sft`` runs on each rank that torchrun starts) with the
arguments a user passes on its command line, ``--fsdp`` naming a JSON file like ms-swift's
``fsdp2`` preset with ``offload`` added. Nothing is downloaded: each rank saves a tiny Llama
built from a config with seeded weights and a character-level tokenizer made here, and writes
a dataset of ``messages`` in a temporary folder. Every rank prints each logged step's loss and
gradient norm and the device Trainer chose, from a callback passed as ms-swift takes one
(``swift.callbacks.callbacks_map`` and ``--callbacks``, what an ``--external_plugins`` file does).
"""

import json
import os
import tempfile
from pathlib import Path

# No hub: the model, tokenizer and dataset are local files (ModelScope's client has no offline switch:
# ``--check_model false`` below keeps ms-swift from asking it whether the model is the newest).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# ms-swift refuses FSDP2 where a rank sees two devices or more (it takes that for a device_map run): on Ascend the
# user shows each of the 2 ranks its NPUs with ASCEND_RT_VISIBLE_DEVICES=0,1; the simulated NPU has 8 and does not
# read that variable, so ms-swift's own switch skips the check (swift/utils/env.py, is_mp; nothing else reads it here).
os.environ.setdefault("SWIFT_SINGLE_DEVICE_MODE", "1")

import torch  # noqa: E402
from swift.callbacks import TrainerCallback, callbacks_map  # noqa: E402
from swift.pipelines import sft_main  # noqa: E402
from tiny_sft import STEPS, pairs, report, save_tiny_llama  # noqa: E402


class Report(TrainerCallback):
    """Prints each logged step (tiny_sft.report)."""

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        report(args, state, logs, model)


def write_dataset(path: Path) -> None:
    """Query and response pairs from a seeded generator, in ms-swift's ``messages`` format (JSON lines)."""
    lines = [json.dumps({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
             for question, answer in pairs()]
    path.write_text("\n".join(lines) + "\n")


def write_fsdp_config(path: Path) -> None:
    """ms-swift's ``fsdp2`` preset (swift/config/fsdp2.json) with ``offload``: the parameters kept on the CPU.

    Activation checkpointing off: the tiny model needs none, and recomputing changes no number."""
    path.write_text(json.dumps({
        "fsdp": "full_shard auto_wrap offload",
        "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT",
                        "activation_checkpointing": False},
    }))


def arguments(folder: Path) -> list:
    """A user's ``swift sft`` command line: full SFT in float32, FSDP2 with CPU offload, clip at 1.0."""
    return [
        "--model", str(folder / "model"), "--model_type", "llama", "--template", "default",
        "--tuner_type", "full", "--torch_dtype", "float32", "--fp16", "false", "--bf16", "false",
        "--dataset", str(folder / "train.jsonl"), "--split_dataset_ratio", "0", "--max_length", "128",
        "--dataset_num_proc", "1", "--dataloader_num_workers", "0", "--gradient_checkpointing", "false",
        "--output_dir", str(folder / "output"), "--logging_steps", "1", "--save_strategy", "no",
        "--report_to", "none", "--disable_tqdm", "true", "--check_model", "false",  # no hub: not asked if newer
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", str(STEPS),
        "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--max_grad_norm", "1.0",
        "--seed", "0", "--data_seed", "0",
        "--use_cpu", str(not torch.accelerator.is_available()).lower(),  # a CPU-only machine: Accelerate's gloo
        "--fsdp", str(folder / "fsdp_offload.json"), "--callbacks", "report",
    ]


def main() -> None:
    callbacks_map["report"] = Report
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        save_tiny_llama(folder / "model")
        write_dataset(folder / "train.jsonl")
        write_fsdp_config(folder / "fsdp_offload.json")
        sft_main(arguments(folder))


if __name__ == "__main__":
    main()
