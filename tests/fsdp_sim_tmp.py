import torch, torch.distributed as dist, comm, torch.nn as nn, traceback
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy
def run(rank, ws):
    mesh = init_device_mesh("npu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    try:
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        out = model(torch.randn(4, 8)).sum()
        out.backward()
        return ["ok", [str(p.grad.to_local().device) for p in model.parameters()]]
    except Exception:
        return traceback.format_exc()[-1500:]
