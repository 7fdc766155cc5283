import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

# Rank processes import test modules by name; make this folder importable there too.
sys.path.insert(0, os.path.dirname(__file__))

from multiproc import launched_by  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a real CUDA device; `make gpu-check` runs them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def launched(monkeypatch):
    """``launched(env)``: for this test, ``env``'s launcher variables and no other launcher's."""
    return functools.partial(launched_by, monkeypatch=monkeypatch)


@pytest.fixture
def nccl_group(tmp_path):
    """A 1-rank nccl group bound to cuda:0, as a single-GPU job has."""
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()
