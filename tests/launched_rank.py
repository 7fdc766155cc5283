"""One rank as srun or mpirun starts it: only the launcher's variables say who it is.

Sets up the simulated NPU, calls ``comm.init_process_group()`` with no arguments,
all-reduces ``rank + 1`` with torch's own call and prints what it saw as JSON.
"""

import json
import os

import torch
import torch.distributed as dist

import comm
import comm.testing


def main() -> None:
    comm.testing.simulate_accelerator("npu", "hccl")
    info = comm.launch_info()
    device = comm.init_process_group()
    value = torch.tensor([float(info.rank + 1)], device=device)
    dist.all_reduce(value)
    print(json.dumps({
        "launcher": info.launcher,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "master_addr": info.master_addr,
        "master_port": info.master_port,
        "device": str(device),
        "current_index": torch.npu.current_device(),
        "backend": dist.get_backend(),
        "sum": value.cpu().item(),
        "torchrun_variables": sorted(set(os.environ) & {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"}),
    }))
    dist.barrier()  # no rank leaves, taking the store down, while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
