"""One rank of a job that a real launcher started: no line here names a launcher or a device.

    mpirun -np 2 python rank.py [--simulate npu]
    srun -n 2 python rank.py [--simulate npu]

Binds with ``comm.init_process_group()`` (no argument: the launcher's variables say
who this process is and where rank 0 listens), all-reduces ``rank + 1`` on the bound
device with torch's own call and in a CPU tensor with ``comm.all_reduce`` (staged onto
the device where the group's backend serves only the accelerator), and prints one
line, ``COMM_RANK {json}``, saying what it saw.
"""

import argparse
import json
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

    info = comm.launch_info()
    device = comm.init_process_group()
    rank = dist.get_rank()
    on_device = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(on_device)
    on_cpu = torch.full((4,), float(rank + 1))
    comm.all_reduce(on_cpu)
    report = {
        "launcher": info.launcher,
        "rank": rank,
        "world_size": dist.get_world_size(),
        "launch": {"rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
                   "local_world_size": info.local_world_size, "node_rank": info.node_rank},
        "master_addr": info.master_addr,
        "master_port": info.master_port,
        "sources": {key: info.sources[key] for key in ("launcher", "local_rank", "master_addr", "master_port")},
        "device": str(device),
        "current_device": str(comm.current_device()),
        "backend": dist.get_backend(),
        "sum_on_device": on_device.cpu().tolist(),
        "sum_on_cpu": on_cpu.tolist(),
    }
    sys.stdout.write("COMM_RANK " + json.dumps(report) + "\n")  # one write: ranks' lines do not interleave
    sys.stdout.flush()
    dist.barrier()  # no rank leaves, taking the store down, while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
