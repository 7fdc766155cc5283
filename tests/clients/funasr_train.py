"""FunASR's own trainer, ``funasr.bin.train``, on a tiny Transformer ASR model with the conv2d input layer.

    torchrun --nproc-per-node 2 funasr_train.py [++key=value ...]
    python funasr_train.py ++device=cpu                     # FunASR's one-process run on the CPU

This is what ``torchrun -m funasr.bin.train --config-path ... --config-name ...`` does:
the script makes the job's files, then calls FunASR's ``main_hydra`` with the command
line a FunASR user types (the arguments after the script's name are added to it).
FunASR does all the rest itself: ``init_process_group`` with its default backend
``nccl``, ``torch.cuda.set_device(local_rank)``, ``model.cuda(local_rank)`` in DDP, its
dataloader, SGD with warmup, ``clip_grad_norm_`` (at 1.0: it binds, the norm is about
35), validation and a checkpoint after every step (``save_checkpoint_interval: 1``).

Nothing is downloaded: the configuration (a Transformer with ``input_layer: conv2d``, as
FunASR's AISHELL recipes have it, at a tiny size, without dropout, SpecAugment or
dither, so that runs can be compared), the character token list and the audio (seeded
random 16 kHz waveforms of one length, written as wav files and listed in FunASR's jsonl
format) are made at run time in a temporary folder. Per rank the batch is
``BATCH // WORLD_SIZE`` utterances, taken in order (``shuffle: false``): a one-process
run trains on the union of the ranks' batches. No torchaudio: FunASR reads the wav
files with soundfile and computes fbank with kaldi-native-fbank.

FunASR's text log rounds losses to 3 decimals and no log of its has the gradient norm;
its checkpoints hold full values. After FunASR's ``main`` returns, rank 0 (the one that
saves) prints per step, from FunASR's checkpoint of that step: the training loss FunASR
keeps (``train_loss_avg``, the mean over the steps so far, and over the ranks, which
all-reduce it), the sum of the parameters, the device the checkpoint's tensors were
saved from, and the validation loss FunASR recorded after the step.
"""
import json
import os
import random
import sys
import tempfile

import numpy as np
import soundfile
import torch
from funasr.bin.train import main_hydra

STEPS = 3
BATCH = 4  # utterances per step, over all ranks
VALID = 2
SAMPLE_RATE = 16000
SAMPLES = 8000  # 0.5 s each, all of one length: no padding, which the conv2d subsampling would see
LETTERS = "abcdefghij"
TOKENS = ["<blank>", "<s>", "</s>", *LETTERS, "<unk>"]

CONFIG = """\
model: Transformer
model_conf:
  ctc_weight: 0.3
  lsm_weight: 0.1
  length_normalized_loss: false
encoder: TransformerEncoder
encoder_conf:
  output_size: 32
  attention_heads: 2
  linear_units: 64
  num_blocks: 2
  dropout_rate: 0.0
  positional_dropout_rate: 0.0
  attention_dropout_rate: 0.0
  input_layer: conv2d
  normalize_before: true
decoder: TransformerDecoder
decoder_conf:
  attention_heads: 2
  linear_units: 64
  num_blocks: 1
  dropout_rate: 0.0
  positional_dropout_rate: 0.0
  self_attention_dropout_rate: 0.0
  src_attention_dropout_rate: 0.0
frontend: WavFrontend
frontend_conf:
  fs: 16000
  window: hamming
  n_mels: 40
  frame_length: 25
  frame_shift: 10
  lfr_m: 1
  lfr_n: 1
  dither: 0.0
specaug: null
normalize: null
ctc_conf:
  dropout_rate: 0.0
  ctc_type: builtin
  reduce: true
  ignore_nan_grad: true
tokenizer: CharTokenizer
tokenizer_conf:
  unk_symbol: <unk>
dataset: AudioDataset
dataset_conf:
  index_ds: IndexDSJsonl
  batch_sampler: BatchSampler
  batch_type: example
  shuffle: false
  num_workers: 0
  pin_memory: false
train_conf:
  max_epoch: 1
  log_interval: 1
  save_checkpoint_interval: 1
  grad_clip: 1.0
optim: sgd
optim_conf:
  lr: 0.1
scheduler: warmuplr
scheduler_conf:
  warmup_steps: 2
ncpu: 1
"""


def write_data(folder: str, name: str, count: int, generator: random.Random) -> str:
    """``count`` seeded random utterances as wav files, listed as FunASR's jsonl (key, source, target, lengths)."""
    listing = os.path.join(folder, f"{name}.jsonl")
    with open(listing, "w") as file:
        for index in range(count):
            key = f"{name}{index:03d}"
            waveform = np.random.default_rng(generator.randrange(2**32)).uniform(-0.5, 0.5, SAMPLES)
            path = os.path.join(folder, f"{key}.wav")
            soundfile.write(path, waveform.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
            text = "".join(generator.choices(LETTERS, k=generator.randint(3, 6)))
            file.write(json.dumps({"key": key, "source": path, "source_len": SAMPLES // 160,
                                   "target": text, "target_len": len(text)}) + "\n")
    return listing


def arguments(folder: str) -> list:
    """FunASR's command line (hydra): the configuration, the data lists, the token list and the output folder."""
    with open(os.path.join(folder, "config.yaml"), "w") as file:
        file.write(CONFIG)
    with open(os.path.join(folder, "tokens.txt"), "w") as file:
        file.write("\n".join(TOKENS) + "\n")
    generator = random.Random(1234)
    return [
        "--config-path", folder,
        "--config-name", "config.yaml",
        f"++train_data_set_list={write_data(folder, 'train', STEPS * BATCH, generator)}",
        f"++valid_data_set_list={write_data(folder, 'valid', VALID, generator)}",
        f"++tokenizer_conf.token_list={os.path.join(folder, 'tokens.txt')}",
        f"++dataset_conf.batch_size={BATCH // int(os.environ.get('WORLD_SIZE', '1'))}",
        f"++output_dir={os.path.join(folder, 'exp')}",
        f"hydra.run.dir={os.path.join(folder, 'hydra')}",
    ]


def load(path: str) -> tuple:
    """A checkpoint FunASR saved, onto the CPU, and the devices its tensors were saved from."""
    devices = set()

    def onto_cpu(storage, location):
        devices.add(location)
        return storage

    return torch.load(path, map_location=onto_cpu, weights_only=False), devices


def report(output: str) -> None:
    """Each step's numbers from FunASR's checkpoint of that step (``model.pt.ep0.<step>``)."""
    for step in range(1, STEPS + 1):
        name = f"model.pt.ep0.{step}"
        state, devices = load(os.path.join(output, name))
        checksum = sum(tensor.double().sum().item() for tensor in state["state_dict"].values())
        sys.stdout.write(f"rank 0: step {step} loss {state['train_loss_avg']:.8f} checksum {checksum:.8f} "
                         f"on {','.join(sorted(devices))} (validation loss "
                         f"{state['val_loss_step_or_epoch'][name]:.8f})\n")
    sys.stdout.flush()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        sys.argv = [sys.argv[0], *arguments(folder), *sys.argv[1:]]
        main_hydra()
        if int(os.environ.get("RANK", "0")) == 0:
            report(os.path.join(folder, "exp"))


if __name__ == "__main__":
    main()
