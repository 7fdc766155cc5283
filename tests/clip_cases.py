"""``torch.nn.utils.clip_grad_norm_`` in the cases trainers meet, each described as text (tests/test_clip_cases.py).

    torchrun --nproc-per-node 2 tests/clip_cases.py --out DIR [--simulate npu]   # plain torch
    torchrun --nproc-per-node 2 -m comm [--simulate npu] tests/clip_cases.py --out DIR
    torchrun --nproc-per-node 2 tests/clip_cases.py --out DIR --only "FSDP2"      # one case

Each rank writes DIR/rank<r>.json: case name -> what the clip returned (its type, DTensor
placements, dtype, device type and exact value) and the gradients it left (their exact
values), or what it raised. The clip is looked up in ``torch.nn.utils`` at each call, as a
trainer calls it, so whatever stands there under ``-m comm`` is what runs. Every case
starts from the same seed, so two runs are compared value for value.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

# A case makes the parameters (their gradients set) on a device and returns them with the clip's arguments.
Case = Callable[[torch.device], Dict[str, Any]]


def _model(device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).to(device, dtype)


def _backward(model: nn.Module, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
    """A batch that differs by rank, so that gradients differ by rank before any reduction."""
    batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    model(batch.to(device, dtype)).square().sum().backward()


def _local_parameters(device: torch.device, dtype: torch.dtype = torch.float32) -> List[nn.Parameter]:
    """Three plain parameters with gradients of this rank's own (no reduction: torch's clip is local)."""
    generator = torch.Generator().manual_seed(2 + dist.get_rank())
    parameters = []
    for shape in ((4, 3), (5,), (2, 2, 2)):
        parameter = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        parameter.grad = torch.randn(shape, generator=generator).to(device, dtype)
        parameters.append(parameter)
    return parameters


def plain(**clip: Any) -> Case:
    """Plain parameters of this rank's own, clipped with ``clip``'s arguments (max_norm 1.0 unless given)."""
    return lambda device: {"parameters": _local_parameters(device), "max_norm": 1.0, **clip}


def _one_tensor(device: torch.device) -> Dict[str, Any]:
    return {"parameters": _local_parameters(device)[0], "max_norm": 0.5}


def _no_gradients(device: torch.device) -> Dict[str, Any]:
    parameters = _local_parameters(device)
    for parameter in parameters:
        parameter.grad = None
    return {"parameters": parameters, "max_norm": 1.0}


def _bf16(device: torch.device) -> Dict[str, Any]:
    return {"parameters": _local_parameters(device, torch.bfloat16), "max_norm": 1.0}


def _non_finite(error: bool) -> Case:
    def case(device: torch.device) -> Dict[str, Any]:
        parameters = _local_parameters(device)
        parameters[1].grad[2] = math.inf
        return {"parameters": parameters, "max_norm": 1.0, "error_if_nonfinite": error}
    return case


def _main_grad(device: torch.device) -> Dict[str, Any]:
    """Megatron names its fp32 gradient ``main_grad``; torch's clip reads ``.grad`` whatever else it carries."""
    parameters = _local_parameters(device)
    for parameter in parameters:
        parameter.main_grad = torch.zeros_like(parameter)  # type: ignore[attr-defined]
    return {"parameters": parameters, "max_norm": 1.0}


def _ddp(device: torch.device) -> Dict[str, Any]:
    model = DDP(_model(device), device_ids=None if device.type == "cpu" else [device])
    _backward(model, device)
    return {"parameters": model.parameters(), "max_norm": 1.0}


def _fully_sharded(mesh_shape: tuple, offload: bool = False, tensor_parallel: bool = False) -> Case:
    """FSDP2 on a mesh of ``mesh_shape`` (two dimensions: HSDP, or FSDP with tensor parallelism)."""
    def case(device: torch.device) -> Dict[str, Any]:
        model = _model(device)
        names = ("replicate", "shard") if len(mesh_shape) == 2 and not tensor_parallel else ("dp", "tp")
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=names[-len(mesh_shape):])
        fsdp_mesh: DeviceMesh = mesh
        if tensor_parallel:
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fsdp_mesh = mesh["dp"]
        # Pinned memory needs an accelerator: plain torch cannot pin on a CPU-only machine.
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type != "cpu")} if offload else {}
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=fsdp_mesh, **policy)
        fully_shard(model, mesh=fsdp_mesh, **policy)
        _backward(model, device)
        return {"parameters": list(model.parameters()), "max_norm": 1.0}
    return case


CASES: Dict[str, Case] = {
    "local tensors": plain(),
    "one tensor": _one_tensor,
    "no gradients": _no_gradients,
    "norm_type=1": plain(norm_type=1.0),
    "norm_type=3.5": plain(norm_type=3.5),
    "norm_type=inf": plain(norm_type=math.inf),
    "foreach=True": plain(foreach=True),
    "foreach=False": plain(foreach=False),
    "bfloat16": _bf16,
    "non-finite, error_if_nonfinite": _non_finite(True),
    "non-finite, no error": _non_finite(False),
    "max_norm=0": plain(max_norm=0.0),
    "max_norm=1e9 (no clipping)": plain(max_norm=1e9),
    "main_grad beside .grad": _main_grad,
    "DDP": _ddp,
    "FSDP2": _fully_sharded((2,)),
    "FSDP2, norm_type=inf": lambda device: {**_fully_sharded((2,))(device), "norm_type": math.inf},
    "FSDP2 with CPUOffloadPolicy": _fully_sharded((2,), offload=True),
    "HSDP (2 replicas of 1 shard)": _fully_sharded((2, 1)),
    "HSDP (1 replica of 2 shards)": _fully_sharded((1, 2)),
    "FSDP2 and tensor parallel (dp 1, tp 2)": _fully_sharded((1, 2), tensor_parallel=True),
}


def describe_tensor(tensor: torch.Tensor) -> str:
    """Type, placements, dtype, device type and every value exactly (float.hex), of a tensor or DTensor."""
    kind = type(tensor).__name__
    if isinstance(tensor, DTensor):
        kind += f"{tuple(str(p) for p in tensor.placements)}"
        tensor = tensor.to_local()
    values = tensor.detach().to("cpu", torch.float64).flatten().tolist()
    return f"{kind} {tensor.dtype} {tensor.device.type} {list(tensor.shape)} [{', '.join(v.hex() for v in values)}]"


def run_case(case: Case, device: torch.device) -> Dict[str, Any]:
    """What the clip returns and leaves in the gradients, or what it raises (first line of its message)."""
    arguments = case(device)
    parameters = arguments["parameters"]
    if not isinstance(parameters, torch.Tensor):
        parameters = arguments["parameters"] = list(parameters)
    listed = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    try:
        norm = torch.nn.utils.clip_grad_norm_(**arguments)
    except Exception as error:  # noqa: BLE001 - what the clip raised is the case's result
        returned = f"raises {type(error).__name__}: {str(error).splitlines()[0]}"
    else:
        returned = describe_tensor(norm)
    grads = [describe_tensor(p.grad) if p.grad is not None else "None" for p in listed]
    return {"returned": returned, "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a folder: each rank writes rank<r>.json there")
    parser.add_argument("--simulate", choices=("npu",), help="plain torch on the simulated NPU (under -m comm, "
                                                              "pass --simulate to comm instead)")
    parser.add_argument("--only", help="run just the case of this name")
    parser.add_argument("--clip", choices=("torch", "comm"), default="torch",
                        help="comm: put comm.clip_grad_norm_ in torch's place (it is not torch's, by design)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # DDP's and FSDP's notes: the same in both runs
    if args.clip == "comm":
        import comm

        torch.nn.utils.clip_grad_norm_ = comm.clip_grad_norm_
    if args.simulate and not hasattr(torch, "npu"):
        from comm.testing import simulate_accelerator

        simulate_accelerator("npu", "hccl")
    rank = int(os.environ["RANK"])
    device = torch.device("npu", rank) if hasattr(torch, "npu") else torch.device("cpu")
    if device.type == "npu":
        torch.npu.set_device(device)
    dist.init_process_group("hccl" if device.type == "npu" else "gloo")
    results = {name: run_case(case, device) for name, case in CASES.items() if args.only in (None, name)}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as out:
        json.dump(results, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The results are written: skip Python's shutdown. torch's collectives can let go of Python objects they took
    # from the caller (a saved-tensor hook, a mode) on a thread of their own after the call ends; if that falls in
    # the interpreter's shutdown, the process aborts ("terminate called without an active exception"). Plain
    # torch on the CPU's gloo did in 15 of 30 runs of a script that all-reduces inside saved_tensors_hooks.
    sys.stdout.flush()
    os._exit(0)
