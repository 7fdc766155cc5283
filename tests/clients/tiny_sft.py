"""What the supervised fine-tuning clients share (llamafactory_sft.py, swift_sft.py): a tiny Llama saved as from a
hub, seeded question and answer pairs, and the line each rank prints per logged step.

Imported by those scripts from their own folder; it names no framework but transformers.
"""

import os
import string
import sys
from pathlib import Path
from typing import Iterator, Tuple

import torch
from tokenizers import Tokenizer, models
from torch.distributed.fsdp import FSDPModule
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

STEPS = 3
SAMPLES = 16
WORDS = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "lambda", "theta", "zeta"]


def save_tiny_llama(folder: Path, dtype: torch.dtype = torch.float32) -> None:
    """A character-level tokenizer (printable ASCII) and a two-layer Llama with seeded weights, saved as from a hub."""
    vocabulary = {token: index for index, token in enumerate(["<unk>", "</s>", *string.printable])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocabulary, [], unk_token="<unk>")),
                                        unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attention_dropout=0.0, eos_token_id=1, pad_token_id=1, bos_token_id=None)
    LlamaForCausalLM(config).to(dtype).save_pretrained(folder)


def pairs() -> Iterator[Tuple[str, str]]:
    """SAMPLES (question, answer) pairs of WORDS, from a seeded generator."""
    generator = torch.Generator().manual_seed(1234)
    for _ in range(SAMPLES):
        words = [WORDS[i] for i in torch.randint(0, len(WORDS), (5,), generator=generator)]
        yield " ".join(words[:3]), " ".join(words[2:])


def report(args, state, logs, model) -> None:
    """A logged step's loss and gradient norm, with the device Trainer chose, whether FSDP2 shards the model and
    where its parameters are: one write per line, so that the ranks' lines do not interleave."""
    if logs and "loss" in logs:
        rank = int(os.environ.get("RANK", "0"))
        sharding = "fsdp2" if isinstance(model, FSDPModule) else "not sharded"
        sys.stdout.write(f"rank {rank}: step {state.global_step} loss {logs['loss']:.8f} "
                         f"grad_norm {float(logs['grad_norm']):.8f} on {args.device.type} "
                         f"({sharding}, parameters on {next(model.parameters()).device.type})\n")
        sys.stdout.flush()
