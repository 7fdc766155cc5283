"""Bind to this rank's accelerator, all-reduce a tensor, release the cache.

Run under torchrun; no line names a device:

    torchrun --standalone --nproc-per-node 2 examples/bind_and_reduce.py
    torchrun --standalone --nproc-per-node 2 examples/bind_and_reduce.py --simulate npu
"""

import argparse
import sys

import torch
import torch.distributed as dist

import comm
import comm.testing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", metavar="DEVICE", help="simulate an accelerator (e.g. npu) on a CPU-only machine")
    args = parser.parse_args()
    if args.simulate:
        comm.testing.simulate_accelerator(args.simulate)

    device = comm.init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    total = value.cpu()[0].item()
    comm.empty_cache()
    status = "ok" if total == expected else f"WRONG (expected {expected})"
    line = f"rank {rank}/{world_size}: device={device} backend={dist.get_backend()} all_reduce sum={total:g} {status}"
    sys.stdout.write(line + "\n")  # one write, so ranks' lines do not interleave
    sys.stdout.flush()
    dist.destroy_process_group()
    if total != expected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
