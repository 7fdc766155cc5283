"""Trainers written for CUDA, unchanged, under comm: two simulated NPUs (hccl) and a CPU-only machine (gloo).

Each rank's losses are compared with a one-process reference: the union of the
ranks' batches in one process, whose gradient is DDP's average.
"""

import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from test_examples import EXAMPLES, _torchrun, example

from multiproc import free_port, no_cuda_errors, quiet_env, skip_unless_simulation

pytestmark = pytest.mark.integration  # the integration tier: make test-integration


def _train_on_the_union(model, learning_rate, batches):
    """Losses of one process that trains on each step's batches of every rank, concatenated."""
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    losses = []
    for per_rank in batches:
        inputs = torch.cat([x for x, _ in per_rank])
        targets = torch.cat([y for _, y in per_rank])
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _trainer_reference(epochs=2, world_size=2):
    from torch.utils.data import DistributedSampler

    trainer = example("cuda_trainer")
    dataset = trainer.make_dataset()
    batches = []
    for epoch in range(epochs):
        orders = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        size = trainer.BATCH_SIZE
        for start in range(0, len(orders[0]), size):
            batches.append([dataset[order[start:start + size]] for order in orders])
    return _train_on_the_union(trainer.make_model(), trainer.LEARNING_RATE, batches)


def _mean_losses(stdout, pattern, world_size=2):
    """Per step, the mean over ranks of the losses the ranks printed (in step order), and the devices they named."""
    found = re.findall(pattern, stdout)
    steps = {}
    for rank, step, loss, device in found:
        steps.setdefault(step, {})[int(rank)] = (float(loss), device)
    assert steps and all(len(ranks) == world_size for ranks in steps.values()), stdout
    means = [sum(loss for loss, _ in ranks.values()) / world_size for _, ranks in sorted(steps.items())]
    devices = {rank: device for ranks in steps.values() for rank, (_, device) in ranks.items()}
    return means, devices


_TRAINER_STEP = r"rank (\d): epoch (\d) step (\d) loss (\S+) on (\S+)"


def _check_trainer(stdout, device, backend):
    means, devices = _mean_losses(stdout, _TRAINER_STEP.replace(r"epoch (\d) step (\d)", r"epoch (\d step \d)"))
    assert means == pytest.approx(_trainer_reference(), rel=1e-5, abs=1e-6)
    assert devices == {rank: device.format(rank=rank) for rank in (0, 1)}
    for rank in (0, 1):
        assert f"rank {rank}: all_reduce sum 3" in stdout
        assert re.search(rf"rank {rank}/2: cuda available True, \d+ devices, current {rank}, model on "
                         rf"{re.escape(device.format(rank=rank))}, backend {backend}", stdout), stdout
    return re.findall(r"rank \d: epoch \d memory allocated (\d+) peak (\d+) reserved (\d+) -> (\d+)", stdout)


def test_cuda_trainer_on_two_simulated_npus():
    skip_unless_simulation()
    run = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "comm", "--simulate", "npu",
                    str(EXAMPLES / "cuda_trainer.py"))
    assert run.returncode == 0, run.stderr
    memory = _check_trainer(run.stdout, "npu:{rank}", "hccl")
    assert len(memory) == 4  # 2 ranks x 2 epochs
    # The cache released: what stays reserved is the blocks still in use (the model's), as torch_npu's allocator keeps
    # them, less than before and no less than what is allocated.
    for allocated, peak, reserved, after in ([int(n) for n in line] for line in memory):
        assert 0 < allocated <= peak and allocated <= after < reserved, (allocated, peak, reserved, after)


def test_cuda_trainer_on_a_cpu_only_machine_and_without_comm():
    run = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "comm", str(EXAMPLES / "cuda_trainer.py"))
    assert run.returncode == 0, run.stderr
    memory = _check_trainer(run.stdout, "cpu", "gloo")
    assert {values for values in memory} == {("0", "0", "0", "0")}  # the CPU has no allocator statistics
    plain = _torchrun("--standalone", "--nproc-per-node", "1", str(EXAMPLES / "cuda_trainer.py"))  # as every rank
    assert plain.returncode != 0
    assert no_cuda_errors()["set_device"] in plain.stderr


def _spawn_reference(world_size=2):
    trainer = example("cuda_spawn_trainer")
    batches = [[trainer.batch(step, rank) for rank in range(world_size)] for step in range(trainer.STEPS)]
    return _train_on_the_union(trainer.make_model(), trainer.LEARNING_RATE, batches)


def _spawned(*comm_options):
    command = [sys.executable, *comm_options, str(EXAMPLES / "cuda_spawn_trainer.py")]
    return subprocess.run(command, capture_output=True, text=True, env=quiet_env(MASTER_PORT=str(free_port())),
                          timeout=240)


def test_mp_spawn_trainer_runs_its_children_in_the_drop_in_mode():
    """On two simulated NPUs (tests/test_translate.py spawns a child on a CPU-only machine)."""
    skip_unless_simulation()
    run = _spawned("-m", "comm", "--simulate", "npu")
    assert run.returncode == 0, run.stderr
    means, devices = _mean_losses(run.stdout, r"rank (\d): step (\d) loss (\S+) on (\S+) backend hccl")
    assert means == pytest.approx(_spawn_reference(), rel=1e-5, abs=1e-6)
    assert devices == {rank: f"npu:{rank}" for rank in (0, 1)}


def test_mp_spawn_trainer_fails_without_comm():
    plain = _spawned()
    assert plain.returncode != 0 and no_cuda_errors()["nccl"] in plain.stderr
