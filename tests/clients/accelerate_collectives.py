"""Accelerate's gather, reduce and broadcast of each rank's tensor, on the accelerator or on the CPU.

    torchrun --nproc-per-node 2 accelerate_collectives.py --on accelerator|cpu [--ops reduce,broadcast,gather]

Accelerate picks the device and backend itself (hccl on Ascend, nccl on CUDA, gloo on
the CPU); CPU tensors are what metrics and offloaded states leave on the host. Each
rank prints one line per operation as it completes.
"""

import argparse

import torch
from accelerate import PartialState
from accelerate.utils import broadcast, gather, reduce

OPERATIONS = {
    "reduce": lambda tensor: reduce(tensor, reduction="sum"),
    "broadcast": lambda tensor: broadcast(tensor, from_process=0),
    "gather": gather,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--on", choices=["accelerator", "cpu"], required=True)
    parser.add_argument("--ops", default="reduce,broadcast,gather", help="comma-separated, run in this order")
    args = parser.parse_args()
    state = PartialState()
    device = state.device if args.on == "accelerator" else torch.device("cpu")
    for name in args.ops.split(","):
        mine = torch.tensor([state.process_index + 1.0], device=device)  # rank + 1
        result = OPERATIONS[name](mine)
        print(f"rank {state.process_index}: {args.on} {name} {result.tolist()} on {result.device.type} "
              f"({state.backend})", flush=True)
    state.destroy_process_group()


if __name__ == "__main__":
    main()
