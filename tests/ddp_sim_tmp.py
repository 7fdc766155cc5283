import torch, torch.distributed as dist, comm, torch.nn as nn, traceback
def run(rank, ws):
    device = comm.current_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    try:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank)).to(device)
            loss = ddp(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        return ["ok", losses, [p.sum().item() for p in model.parameters()][:2]]
    except Exception:
        return traceback.format_exc()[-1800:]
