"""A full (unsharded) state dict gathered from FSDP2 shards offloaded to the CPU.

Saving a checkpoint that loads without FSDP means gathering every sharded
parameter, as training scripts commonly write it: ``value.full_tensor()`` for
each entry of ``model.state_dict()``, a functional all-gather. With
CPUOffloadPolicy the shards are on the CPU while the mesh is on the accelerator,
so on an NPU (hccl) or GPU (nccl) torch fails with the FSDP offload report's
error (torch's get_model_state_dict and torchtune copy the shards to the device
by hand first); under `python -m comm` the gather is staged through the
accelerator and comes back on the CPU. The script has no line of comm in it.

    torchrun --standalone --nproc-per-node 2 examples/full_state_dict.py --simulate npu           # fails
    torchrun --standalone --nproc-per-node 2 -m comm examples/full_state_dict.py --simulate npu   # works

``--simulate npu`` sets up comm's simulated NPU first (a CPU-only machine); on a
real accelerator leave it out.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", metavar="DEVICE", help="set up comm's simulated accelerator (npu)")
    args = parser.parse_args()
    if args.simulate:
        import comm.testing

        comm.testing.simulate_accelerator(args.simulate, "hccl")
    accelerator = torch.accelerator.current_accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(device_id=torch.device(accelerator.type, local_rank))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    mesh = init_device_mesh(accelerator.type, (world_size,))
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    shard = next(model.parameters())
    if rank == 0:
        print(f"FSDP2 on {world_size} {accelerator.type} ranks ({dist.get_backend()}); "
              f"parameter shards on {shard.to_local().device.type}, mesh on {shard.device_mesh.device_type}")

    full = {name: value.full_tensor() for name, value in model.state_dict().items()}
    if rank == 0:
        reference = build_model().state_dict()
        same = full.keys() == reference.keys() and all(torch.equal(full[k], reference[k]) for k in reference)
        devices = sorted({tensor.device.type for tensor in full.values()})
        print(f"full state dict: {len(full)} tensors, {sum(t.numel() for t in full.values())} values on {devices}; "
              f"equal to the unsharded model's: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
