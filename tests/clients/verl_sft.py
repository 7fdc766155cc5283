"""verl's torchrun SFT trainer (``verl.trainer.sft_trainer``), full SFT of a tiny Llama: FSDP2, CPU offload, clipping.

    torchrun --nproc-per-node 2 verl_sft.py     # verl's trainer on each rank
    python verl_sft.py --one-process            # the reference: the same steps in one process, plain torch

verl's own ``main`` (what ``torchrun -m verl.trainer.sft_trainer key=value ...`` runs on each
rank) with the overrides a user passes on that command line: the FSDP engine with
``engine.strategy=fsdp2`` and ``engine.offload_policy=True`` (verl's FSDP2 CPU offload:
``CPUOffloadPolicy``, parameters, gradients and optimizer state on the CPU), clipping at
``optim.clip_grad=1.0``. Nothing is downloaded: each rank saves a tiny Llama built from a config
with seeded weights and a character-level tokenizer made here (its chat template through verl's
``model.custom_chat_template``), and writes a parquet dataset of ``messages``, in a temporary folder.

verl averages the loss over the data-parallel group and logs it, with the gradient norm, on the
first rank only (its tracking, here its ``file`` logger): rank 0 prints each logged step, with
where the optimizer found the parameters at that step (a global optimizer hook, torch's).
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F
from tiny_sft import STEPS, pairs, save_tiny_llama
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_post_hook

# A template that renders each turn as <role>content</s> and has a generation prompt (<assistant>), which verl's
# MultiTurnSFTDataset leaves out of the loss as it does a real model's.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<' + message['role'] + '>' + message['content'] + eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")
BATCH_PER_RANK = 2
WORLD_SIZE = 2
LEARNING_RATE = 1e-2
WEIGHT_DECAY = 0.01  # verl's default (optim.weight_decay)
MAX_NORM = 1.0


def write_dataset(path: Path) -> None:
    """Question and answer pairs from a seeded generator, as verl's MultiTurnSFTDataset reads them (``messages``)."""
    import pandas as pd

    rows = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            for question, answer in pairs()]
    pd.DataFrame(rows).to_parquet(path)


def overrides(folder: Path) -> List[str]:
    """A user's command line: full SFT in float32, FSDP2 with verl's CPU offload, clip at 1.0, 3 steps of 2 x 2 samples.

    Eager attention and padded micro-batches (no flash-attn here; ``use_remove_padding`` packs sequences for
    flash-attn's varlen kernel); no torch.compile; float32 throughout (verl computes in bfloat16 by default)."""
    return [
        f"data.train_files={folder / 'train.parquet'}", f"data.train_batch_size={BATCH_PER_RANK * WORLD_SIZE}",
        f"data.micro_batch_size_per_gpu={BATCH_PER_RANK}", "data.use_dynamic_bsz=False", "data.max_length=128",
        "data.num_workers=0",
        f"model.path={folder / 'model'}", f'model.custom_chat_template="{CHAT_TEMPLATE}"',
        "model.use_remove_padding=False", "model.enable_gradient_checkpointing=False",
        "+model.override_config.attn_implementation=eager",
        "engine.strategy=fsdp2", "engine.offload_policy=True", "engine.use_torch_compile=False",
        "+engine.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"optim.lr={LEARNING_RATE}", f"optim.weight_decay={WEIGHT_DECAY}", f"optim.clip_grad={MAX_NORM}",
        "optim.lr_scheduler_type=constant",
        f"trainer.total_training_steps={STEPS}", "trainer.total_epochs=1", "trainer.logger=[console,file]",
        "trainer.project_name=comm-clients", "trainer.experiment_name=verl-sft",
        f"trainer.default_local_dir={folder / 'checkpoints'}", "trainer.resume_mode=disable",
        # Hydra's own output (its logs and the composed config) in the temporary folder too.
        f"hydra.run.dir={folder / 'hydra'}", "hydra.output_subdir=null",
    ]


def placement(optimizer: torch.optim.Optimizer) -> str:
    """Where the optimizer's parameters are: the device their mesh spans, whether FSDP2 shards them, where they lie."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params):
        return f"{params[0].device_mesh.device_type} (fsdp2, parameters on {params[0].to_local().device.type})"
    return f"{params[0].device.type} (not sharded, parameters on {params[0].device.type})"


def train() -> None:
    """verl's trainer on this rank; then rank 0 prints each step verl logged."""
    seen: List[str] = []
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: seen.append(placement(optimizer)))
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        save_tiny_llama(folder / "model")
        write_dataset(folder / "train.parquet")
        logged = folder / "metrics.jsonl"
        os.environ["VERL_FILE_LOGGER_PATH"] = str(logged)  # verl's file logger (trainer.logger), rank 0's only
        from verl.trainer import sft_trainer

        sys.argv = [sys.argv[0], *overrides(folder)]
        sft_trainer.main()
        if int(os.environ["RANK"]) == 0:
            for line, where in zip(logged.read_text().splitlines(), seen):
                step = json.loads(line)
                sys.stdout.write(f"rank 0: step {step['step']} loss {step['data']['train/loss']:.8f} "
                                 f"grad_norm {step['data']['train/grad_norm']:.8f} on {where}\n")
            sys.stdout.flush()


def turn(tokenizer, role: str, content: str, generation_prompt: bool = False) -> List[int]:
    """One message alone through the chat template, as verl's MultiTurnSFTDataset tokenizes each turn."""
    return list(tokenizer.apply_chat_template([{"role": role, "content": content}], tokenize=True,
                                              add_generation_prompt=generation_prompt, return_dict=True)["input_ids"])


def tokenized(tokenizer, question: str, answer: str) -> Dict[str, torch.Tensor]:
    """A pair as verl's MultiTurnSFTDataset makes it: the turns' tokens, the answer's after the generation prompt
    in the loss."""
    prompt = len(turn(tokenizer, "user", "", generation_prompt=True)) - len(turn(tokenizer, "user", ""))
    user, assistant = turn(tokenizer, "user", question), turn(tokenizer, "assistant", answer)
    mask = [0] * (len(user) + prompt) + [1] * (len(assistant) - prompt)
    return {"input_ids": torch.tensor(user + assistant), "loss_mask": torch.tensor(mask)}


def one_process() -> None:
    """The reference: verl's 3 steps in one process on the CPU with plain torch and transformers, without verl.

    Each step trains on the union of the two ranks' batches (torch's DistributedSampler, shuffled with seed 0, as
    verl's trainer draws them): the loss is the sum of the answer tokens' negative log-likelihoods over the number of
    answer tokens in the whole batch (verl's sft_loss, whose gradient FSDP2 averages over the ranks), torch's clip at
    1.0 and its AdamW with verl's settings. Prints each step as rank 0 of the trainer does."""
    from torch.utils.data import DistributedSampler
    from transformers import AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        save_tiny_llama(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = CHAT_TEMPLATE
        model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    samples = [tokenized(tokenizer, question, answer) for question, answer in pairs()]
    orders = []
    for rank in range(WORLD_SIZE):
        sampler = DistributedSampler(samples, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, drop_last=True)
        sampler.set_epoch(0)
        orders.append(list(sampler))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.999), weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        start = step * BATCH_PER_RANK
        batch = [samples[index] for order in orders for index in order[start:start + BATCH_PER_RANK]]
        tokens = sum(int(sample["loss_mask"].sum()) for sample in batch)
        total = torch.zeros(())
        for sample in batch:
            ids, mask = sample["input_ids"], sample["loss_mask"]
            log_probs = F.log_softmax(model(ids[None]).logits[0, :-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
            total = total - (log_probs * mask[1:]).sum()
        loss = total / tokens
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        sys.stdout.write(f"rank 0: step {step + 1} loss {loss.item():.8f} grad_norm {norm.item():.8f} "
                         f"on cpu (one process, parameters on cpu)\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-process", action="store_true", help="the reference run, without verl")
    if parser.parse_args().one_process:
        one_process()
    else:
        train()
