"""Collectives on torch_npu's own hccl group, on two ranks over the fake CANN: NPU tensors, then CPU tensors.

Each rank prints one line per call: ``<name> ok``, ``<name> wrong <values>``, or ``<name> failed <error>``.
The values are checked against what the call must give for two ranks; nothing here names comm.
"""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.npu.set_device(rank)
dist.init_process_group("hccl")
world = dist.get_world_size()


def check(name, device, call):
    try:
        got, want = call(device)
        torch.npu.synchronize()
        same = torch.equal(got.cpu(), want)
        say(f"{device} {name} {'ok' if same else 'wrong ' + str(got.cpu().tolist())}")
    except Exception as error:  # noqa: BLE001 (the error is what the test reads)
        say(f"{device} {name} failed {str(error).splitlines()[0]}")


def say(line):
    """One line of this rank's, in one write: the two ranks share the pipe."""
    os.write(1, f"rank {rank} {line}\n".encode())


def all_reduce(device):
    t = torch.full((5,), float(rank + 1), device=device)
    dist.all_reduce(t)
    return t, torch.full((5,), float(sum(range(1, world + 1))))


def broadcast(device):
    t = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    dist.broadcast(t, src=1)
    return t, torch.arange(4, dtype=torch.float32) + 10


def all_gather_into_tensor(device):
    out = torch.empty(3 * world, device=device)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=device))
    return out, torch.arange(world, dtype=torch.float32).repeat_interleave(3)


def reduce_scatter_tensor(device):
    out = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(out, torch.arange(2 * world, dtype=torch.float32, device=device) * (rank + 1))
    return out, torch.arange(2 * world, dtype=torch.float32)[2 * rank:2 * rank + 2] * sum(range(1, world + 1))


def all_gather(device):
    parts = [torch.empty(2, dtype=torch.int32, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), rank, dtype=torch.int32, device=device))
    return torch.cat(parts), torch.arange(world, dtype=torch.int32).repeat_interleave(2)


def reduce(device):
    t = torch.full((3,), float(rank + 1), device=device)
    dist.reduce(t, dst=0)
    # torch leaves the other ranks' tensors unspecified (HCCL keeps them, gloo uses them as scratch)
    return (t, torch.full((3,), float(sum(range(1, world + 1))))) if rank == 0 else (t.zero_(), torch.zeros(3))


def gather(device):
    parts = [torch.empty(2, device=device) for _ in range(world)] if rank == 1 else None
    mine = torch.full((2,), float(rank), device=device)
    dist.gather(mine, parts, dst=1)
    return (torch.cat(parts) if rank == 1 else mine), (torch.arange(world, dtype=torch.float32).repeat_interleave(2)
                                                        if rank == 1 else torch.full((2,), float(rank)))


def scatter(device):
    out = torch.empty(2, device=device)
    parts = [torch.full((2,), float(i), device=device) for i in range(world)] if rank == 0 else None
    dist.scatter(out, parts, src=0)
    return out, torch.full((2,), float(rank))


def all_to_all(device):
    outs = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * rank + i), device=device) for i in range(world)])
    return torch.cat(outs), torch.tensor([10.0 * i + rank for i in range(world) for _ in range(2)])


def all_to_all_single(device):
    # Uneven splits (all_to_all V): rank r sends i + 1 elements to rank i.
    sends = [i + 1 for i in range(world)]
    received = [rank + 1] * world
    out = torch.empty(sum(received), device=device)
    source = torch.cat([torch.full((i + 1,), float(10 * rank + i)) for i in range(world)]).to(device)
    dist.all_to_all_single(out, source, output_split_sizes=received, input_split_sizes=sends)
    return out, torch.cat([torch.full((rank + 1,), float(10 * i + rank)) for i in range(world)])


def send_recv(device):
    received = torch.empty(3, device=device)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank), device=device), (rank + 1) % world),
           dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received, torch.full((3,), float((rank - 1) % world))


for device in ("npu", "cpu"):
    for name, call in [("all_reduce", all_reduce), ("broadcast", broadcast),
                       ("all_gather_into_tensor", all_gather_into_tensor),
                       ("reduce_scatter_tensor", reduce_scatter_tensor), ("all_gather", all_gather),
                       ("reduce", reduce), ("gather", gather), ("scatter", scatter), ("all_to_all", all_to_all),
                       ("all_to_all_single", all_to_all_single), ("send_recv", send_recv)]:
        check(name, device, call)
dist.barrier()
dist.destroy_process_group()
