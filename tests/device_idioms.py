"""The device idioms training code uses, run one by one: what each gives, as text (tests/test_device_idioms.py).

    python tests/device_idioms.py --reference cpu|npu    # plain torch: each idiom's reference
    python -m comm tests/device_idioms.py                # the idioms as written, translated to the CPU
    python -m comm --simulate npu tests/device_idioms.py # ... to the simulated NPU
    python tests/device_idioms.py --as-written           # plain torch, the code as written

Each idiom is one line: a name, the code (statements separated by ``;``, the last an
expression whose value is described), and, where the plain reference is not simply the
code with its CUDA names replaced, the reference code. The reference runs on plain torch
with ``cuda``/``cuda:N`` replaced by the target (``cpu``; ``npu``/``npu:N``) and ``nccl``
by the target's backend, so an idiom that names no CUDA is compared with itself run
plainly.

Every idiom runs in a child forked from this process once it has started (after ``-m
comm`` has patched): each starts from the state a script starts from, and nothing one
idiom does (a default device, a process group, a seed) reaches another. Prints one JSON
object: idiom name -> description.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import tempfile
import traceback
import warnings
from typing import Any, Dict, List, NamedTuple, Optional

import torch

# A one-rank process group on an in-memory store, for the idioms that need one.
GROUP = "dist.init_process_group('nccl', store=dist.HashStore(), rank=0, world_size=1)"


class Idiom(NamedTuple):
    name: str
    code: str
    reference: Optional[str] = None  # None: the code, its CUDA names replaced


def factory(name: str, call: str) -> Idiom:
    """torch.<name> called with ``device='cuda'``: ``call`` is its arguments, ``D`` where the device goes."""
    return Idiom(f"factory {name}(device='cuda')", f"torch.{name}({call.replace('D', repr('cuda'))})")


IDIOMS: List[Idiom] = [
    # Factories: each device form.
    Idiom("factory device=None", "torch.zeros(2)"),
    Idiom("factory device='cpu'", "torch.zeros(2, device='cpu')"),
    Idiom("factory device='meta'", "torch.zeros(2, device='meta')"),
    Idiom("factory device='cuda'", "torch.zeros(2, device='cuda')"),
    Idiom("factory device='cuda:1'", "torch.zeros(2, device='cuda:1')"),
    Idiom("factory device=torch.device('cuda', 1)", "torch.ones(2, device=torch.device('cuda', 1))"),
    Idiom("factory device=torch.device('meta')", "torch.ones(2, device=torch.device('meta'))"),
    Idiom("factory device=0 (an int)", "torch.empty(2, device=0)", "torch.empty(2, device='cuda:0')"),
    # Every factory comm stands in for, with device='cuda'.
    *[factory(name, call) for name, call in [
        ("arange", "3, device=D"), ("as_tensor", "[1.0, 2.0], device=D"), ("bartlett_window", "4, device=D"),
        ("blackman_window", "4, device=D"), ("empty", "2, device=D"), ("empty_like", "torch.ones(2), device=D"),
        ("empty_permuted", "(2, 3), (1, 0), device=D"),
        ("empty_quantized", "[2], torch.quantize_per_tensor(torch.ones(2), 1.0, 0, torch.quint8), device=D"),
        ("empty_strided", "(2, 3), (3, 1), device=D"), ("eye", "2, device=D"),
        ("from_file", "FILE, size=2, dtype=torch.float32, device=D"), ("full", "(2,), 1.5, device=D"),
        ("full_like", "torch.ones(2), 3.0, device=D"), ("hamming_window", "4, device=D"),
        ("hann_window", "4, device=D"), ("kaiser_window", "4, device=D"), ("linspace", "0, 1, 3, device=D"),
        ("logspace", "0, 1, 3, device=D"), ("normal", "0.0, 1.0, (2,), device=D"), ("ones", "2, device=D"),
        ("ones_like", "torch.ones(2), device=D"), ("rand", "2, device=D"), ("rand_like", "torch.ones(2), device=D"),
        ("randint", "0, 5, (2,), device=D"), ("randint_like", "torch.ones(2), 5, device=D"), ("randn", "2, device=D"),
        ("randn_like", "torch.ones(2), device=D"), ("randperm", "3, device=D"), ("range", "0, 2, device=D"),
        ("scalar_tensor", "1.5, device=D"), ("sparse_bsc_tensor", "[0, 1], [0], [[[1.0]]], (1, 1), device=D"),
        ("sparse_bsr_tensor", "[0, 1], [0], [[[1.0]]], (1, 1), device=D"),
        ("sparse_compressed_tensor", "[0, 1], [0], [1.0], (1, 1), layout=torch.sparse_csr, device=D"),
        ("sparse_coo_tensor", "[[0]], [1.0], (2,), device=D"),
        ("sparse_csc_tensor", "[0, 1], [0], [1.0], (1, 1), device=D"),
        ("sparse_csr_tensor", "[0, 1], [0], [1.0], (1, 1), device=D"), ("tensor", "[1.0, 2.0], device=D"),
        ("tril_indices", "3, 3, device=D"), ("triu_indices", "3, 3, device=D"), ("zeros", "2, device=D"),
        ("zeros_like", "torch.ones(2), device=D"), ("asarray", "[1.0, 2.0], device=D"),
    ]],
    Idiom("factory frombuffer", "torch.frombuffer(bytearray(8), dtype=torch.float32)"),
    # Device contexts and the default device.
    Idiom("context meta", "with torch.device('meta'): r = (torch.zeros(2), torch.arange(2), torch.tensor([1.0]))\nr"),
    Idiom("context meta, nn.Linear", "with torch.device('meta'): m = nn.Linear(2, 2)\nm"),
    Idiom("context cpu", "with torch.device('cpu'): r = torch.zeros(2)\nr"),
    Idiom("context cuda", "with torch.device('cuda'): r = (torch.zeros(2), nn.Linear(2, 2))\nr"),
    Idiom("context cuda:1", "with torch.device('cuda:1'): r = torch.ones(2)\nr"),
    Idiom("context accelerator", "with torch.device(ACC): r = (torch.zeros(1), nn.Linear(2, 2))\nr"),
    Idiom("context nested", "with torch.device('meta'):\n with torch.device('cuda'): a = torch.zeros(1)\n"
          " b = torch.zeros(1)\n(a, b, torch.zeros(1))"),
    Idiom("context: an explicit device wins", "with torch.device('meta'): r = torch.zeros(1, device='cpu')\nr"),
    Idiom("set_default_device meta", "torch.set_default_device('meta'); (torch.empty(1), torch.get_default_device())"),
    Idiom("set_default_device cuda", "torch.set_default_device('cuda'); (torch.empty(1), torch.get_default_device())"),
    Idiom("set_default_device cuda:1", "torch.set_default_device('cuda:1'); (nn.Linear(1, 1), "
          "torch.get_default_device())"),
    Idiom("set_default_device then None", "torch.set_default_device('meta'); torch.set_default_device(None); "
          "(torch.empty(1), torch.get_default_device())"),
    Idiom("get_default_device", "torch.get_default_device()"),
    # Modules and meta initialisation.
    Idiom("nn.Linear(device='meta')", "nn.Linear(2, 2, device='meta')"),
    Idiom("nn.Linear(device='cuda')", "nn.Linear(2, 2, device='cuda')"),
    Idiom("meta init, to_empty, reset_parameters",
          "with torch.device('meta'): m = nn.Linear(2, 2)\nm = m.to_empty(device='cuda'); m.reset_parameters(); m"),
    Idiom("meta init, to_empty on the CPU", "with torch.device('meta'): m = nn.Linear(2, 2)\nm.to_empty(device='cpu')"),
    Idiom("Module.to('cuda')", "nn.Linear(2, 2).to('cuda')"),
    Idiom("Module.to(dtype)", "nn.Linear(2, 2).to(torch.float64)"),
    Idiom("Module.cuda()", "nn.Linear(2, 2).cuda()", "nn.Linear(2, 2).to('cuda')"),
    Idiom("Module.cuda(1)", "nn.Linear(2, 2).cuda(1)", "nn.Linear(2, 2).to('cuda:1')"),
    # .to's arguments read as Module.to reads them, and libraries moving their own containers (TensorDict.to).
    Idiom("_parse_to(0) (an int)", "torch._C._nn._parse_to(0)", "torch._C._nn._parse_to('cuda:0')"),
    Idiom("_parse_to('cuda:1'), then .to", "p = torch._C._nn._parse_to('cuda:1', non_blocking=True); "
          "(p, torch.ones(2).to(p[0]))"),
    Idiom("_parse_to(device=, dtype=), then .to", "p = torch._C._nn._parse_to(device=torch.device('cuda'), "
          "dtype=torch.float64); (p, torch.ones(2).to(*p[:2]))"),
    Idiom("_parse_to('meta')", "torch._C._nn._parse_to('meta')"),
    Idiom("_parse_to(dtype)", "torch._C._nn._parse_to(torch.float16, memory_format=torch.channels_last)"),
    Idiom("_parse_to(other)", "torch._C._nn._parse_to(torch.zeros(1, dtype=torch.int64))"),
    # Tensors.
    Idiom("Tensor.to('cuda')", "torch.ones(2).to('cuda')"),
    Idiom("Tensor.to('cuda:1', non_blocking)", "torch.ones(2).to('cuda:1', non_blocking=True)"),
    Idiom("Tensor.to(device=, dtype=)", "torch.ones(2).to(device=torch.device('cuda'), dtype=torch.float64)"),
    Idiom("Tensor.to('meta')", "torch.ones(2).to('meta')"),
    Idiom("Tensor.to(dtype)", "torch.ones(2).to(torch.float16)"),
    Idiom("Tensor.to(other)", "torch.ones(2).to(torch.zeros(1, dtype=torch.int64))"),
    Idiom("Tensor.to as a function", "torch.Tensor.to(torch.ones(2), 'cuda')"),
    Idiom("Tensor.cuda()", "torch.ones(2).cuda()", "torch.ones(2).to('cuda')"),
    Idiom("Tensor.cuda(1)", "torch.ones(2).cuda(1)", "torch.ones(2).to('cuda:1')"),
    *[Idiom(f"Tensor.{name}(device='cuda')", f"torch.ones(2).{name}({call}device='cuda')")
      for name, call in [("new_empty", "(2,), "), ("new_zeros", "(2,), "), ("new_ones", "(2,), "),
                         ("new_full", "(2,), 1.5, "), ("new_tensor", "[1.0], ")]],
    Idiom("Tensor.pin_memory()", "torch.ones(2).pin_memory().is_pinned()", {"cpu": "False", "npu": None}),
    # Checkpoints.
    Idiom("torch.load(map_location='cuda')", "torch.load(BUF, map_location='cuda')"),
    Idiom("torch.load(map_location='cpu')", "torch.load(BUF, map_location='cpu')"),
    Idiom("torch.load(map_location=None)", "torch.load(BUF)"),
    Idiom("torch.load(map_location=a callable)", "torch.load(BUF, map_location=lambda s, loc: s)"),
    # Generators and mixed precision.
    Idiom("torch.Generator(device='cpu')", "torch.Generator(device='cpu')"),
    Idiom("torch.Generator(device='cuda')", "torch.Generator(device='cuda')"),
    Idiom("torch.Generator('cuda') draws", "g = torch.Generator('cuda').manual_seed(3); "
          "torch.rand(3, device='cuda', generator=g)"),
    Idiom("torch.cuda.manual_seed", "torch.cuda.manual_seed(3); torch.rand(3, device='cuda')",
          {"cpu": "torch.rand(3)", "npu": None}),  # on the CPU, torch.cuda.manual_seed reseeds nothing
    Idiom("torch.autocast('cuda')", "with torch.autocast('cuda', dtype=torch.bfloat16): r = torch.mm(torch.ones(2, 2, "
          "device='cuda'), torch.ones(2, 2, device='cuda'))\nr"),
    Idiom("torch.autocast('cpu')", "with torch.autocast('cpu'): r = torch.mm(torch.ones(2, 2), torch.ones(2, 2))\nr"),
    Idiom("torch.amp.GradScaler('cuda')", "s = torch.amp.GradScaler('cuda'); (s._device, s.is_enabled())"),
    Idiom("torch.amp.GradScaler('cpu')", "s = torch.amp.GradScaler('cpu'); (s._device, s.is_enabled())"),
    # torch.cuda's device functions.
    Idiom("torch.cuda.device(1)", "with torch.cuda.device(1): r = torch.zeros(1, device='cuda')\nr",
          {"cpu": "torch.zeros(1)", "npu": "with torch.npu.device(1): r = torch.zeros(1, device='npu')\nr"}),
    Idiom("torch.cuda.set_device(1)", "torch.cuda.set_device(1); (torch.cuda.current_device(), torch.ones(1).cuda())",
          {"cpu": "(1, torch.ones(1))", "npu": "torch.npu.set_device(1); (torch.npu.current_device(), "
           "torch.ones(1).to('npu'))"}),
    # Process groups.
    Idiom("init_process_group('nccl')", f"{GROUP}; (dist.get_backend(), dist.get_world_size())"),
    Idiom("init_process_group('cpu:gloo,cuda:nccl')", "dist.init_process_group('cpu:gloo,cuda:nccl', "
          "store=dist.HashStore(), rank=0, world_size=1); dist.get_backend()",
          {"cpu": "dist.init_process_group('cpu:gloo', store=dist.HashStore(), rank=0, world_size=1); "
                  "dist.get_backend()", "npu": None}),
    Idiom("init_process_group(device_id=)", "dist.init_process_group('nccl', store=dist.HashStore(), rank=0, "
          "world_size=1, device_id=torch.device('cuda', 0)); dist.get_backend()",
          {"cpu": GROUP + "; dist.get_backend()", "npu": None}),
    Idiom("new_group('nccl')", f"{GROUP}; dist.get_backend(dist.new_group([0], backend='nccl'))"),
    Idiom("init_device_mesh('cuda')", f"{GROUP}; init_device_mesh('cuda', (1,)).device_type"),
    Idiom("DDP(device_ids=[0])", f"{GROUP}; m = nn.Linear(2, 2).cuda(); DDP(m, device_ids=[0])(torch.ones(1, 2, "
          "device='cuda'))", {"cpu": f"{GROUP}; DDP(nn.Linear(2, 2))(torch.ones(1, 2))", "npu": None}),
    Idiom("DataLoader(pin_memory=True)", "next(iter(DataLoader(torch.ones(4, 2), batch_size=2, pin_memory=True, "
          "pin_memory_device='cuda')))", {"cpu": "next(iter(DataLoader(torch.ones(4, 2), batch_size=2)))",
                                          "npu": None}),
    # What torch keys on by identity: pickling, torch.fx, TorchScript, compile.
    Idiom("pickle a factory", "pickle.loads(pickle.dumps(torch.zeros)) is torch.zeros"),
    Idiom("pickle Tensor.to", "pickle.loads(pickle.dumps(torch.Tensor.to)) is torch.Tensor.to"),
    Idiom("torch.fx traces a factory and Tensor.to", "[(n.op, getattr(n.target, '__name__', n.target), "
          "sorted(map(str, n.kwargs.values()))) for n in torch.fx.symbolic_trace(lambda x: torch.zeros_like(x, "
          "device='cuda') + x.to('cuda')).graph.nodes]"),
    Idiom("a torch.fx trace runs", "torch.fx.symbolic_trace(lambda x: torch.zeros_like(x, device='cuda') + "
          "x.to('cuda'))(torch.ones(2))"),
    Idiom("torch.overrides knows the factories", "torch.zeros in torch.overrides.get_ignored_functions()"),
    Idiom("compiled factories", "f = torch.compile(lambda x: x + torch.zeros(2, device='cuda') + x.new_ones(2), "
          "fullgraph=True, backend='eager'); f(torch.ones(2, device='cuda'))"),
    Idiom("compiled module moved by .cuda()", "m = torch.compile(nn.Linear(2, 2).cuda(), fullgraph=True, "
          "backend='eager'); m(torch.ones(1, 2).cuda()).device", "m = torch.compile(nn.Linear(2, 2).to('cuda'), "
          "fullgraph=True, backend='eager'); m(torch.ones(1, 2).to('cuda')).device"),
]


def reference(idiom: Idiom, target: str) -> str:
    """The plain code ``idiom`` is compared with on ``target`` (``cpu`` or ``npu``)."""
    code = idiom.reference
    if isinstance(code, dict):
        code = code[target]
    if code is None:
        code = idiom.code
    backend = "gloo" if target == "cpu" else "hccl"
    code = re.sub(r"\bcuda(:\d+)?", (lambda m: "cpu") if target == "cpu" else (lambda m: "npu" + (m.group(1) or "")),
                  code)
    return code.replace("nccl", backend)


def describe(value: Any, values: bool = True) -> str:
    """What an idiom gave, as text that names devices, dtypes, shapes and (with ``values``) small tensors' values."""
    if isinstance(value, torch.Tensor):
        text = f"tensor {value.device} {value.dtype} {tuple(value.shape)} {value.layout}"
        if values and value.device.type != "meta" and value.layout == torch.strided and not value.is_quantized \
                and value.numel() <= 8:
            text += f" {[round(float(x), 5) for x in value.detach().cpu().flatten().tolist()]}"
        return text
    if isinstance(value, torch.nn.Module):
        tensors = list(value.parameters()) + list(value.buffers())
        return f"{type(value).__name__} on {sorted({str(t.device) for t in tensors})}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe(item, values) for item in value) + ")"
    if isinstance(value, torch.Generator):
        return f"generator {value.device}"
    if isinstance(value, (bool, int, float, str, torch.device, torch.dtype, torch.memory_format)) or value is None:
        return repr(value)
    return type(value).__name__


def namespace() -> Dict[str, Any]:
    """What every idiom may name: torch, its modules, a file and a checkpoint to read, the accelerator's type."""
    import pickle

    import torch.distributed as dist
    import torch.fx
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    handle, path = tempfile.mkstemp()
    os.write(handle, bytes(8))
    os.close(handle)
    buffer = io.BytesIO()
    torch.save(torch.arange(3.0), buffer)
    buffer.seek(0)  # each idiom, in a child of its own, reads it from the start
    import torch._dynamo  # once here, not in each child that compiles (it takes seconds)

    accelerator = torch._C._get_privateuse1_backend_name() if hasattr(torch, "npu") else "cpu"
    return {"torch": torch, "nn": nn, "dist": dist, "pickle": pickle, "DDP": DDP, "DataLoader": DataLoader,
            "init_device_mesh": init_device_mesh, "FILE": path, "BUF": buffer, "ACC": accelerator}


def run(code: str, names: Dict[str, Any]) -> str:
    """Run ``code`` (statements, the last line or ``;``-part an expression) and describe the last value.

    The random generators are seeded alike first; what ``empty`` leaves in memory is not compared.
    """
    lines = code.split("\n")
    *head, last = lines[:-1] + lines[-1].split("; ")
    torch.manual_seed(0)
    try:
        exec(compile("\n".join(head), "<idiom>", "exec"), names)
        return describe(eval(compile(last, "<idiom>", "eval"), names), values="empty" not in code)
    except Exception as error:  # noqa: BLE001 - what the idiom raised is its result
        return f"raises {type(error).__name__}"


def in_child(code: str, names: Dict[str, Any]) -> str:
    """``run(code)`` in a forked child, so that nothing it sets reaches the next idiom."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = run(code, names)
        except BaseException:  # noqa: BLE001 - anything at all: reported, never a hang
            result = "child failed: " + traceback.format_exc(limit=1)
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode() or "child died"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", choices=("cpu", "npu"), help="run each idiom's plain reference on this target")
    parser.add_argument("--as-written", action="store_true", help="run each idiom's code as written")
    parser.add_argument("--out", required=True, help="write the descriptions here as JSON (not stdout: backends print)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # deprecations and betas of the factories called: the same plainly
    if args.reference == "npu":
        from comm.testing import simulate_accelerator

        simulate_accelerator("npu", "hccl")
    names = namespace()
    results = {}
    for idiom in IDIOMS:
        code = idiom.code if args.reference is None else reference(idiom, args.reference)
        results[idiom.name] = in_child(code, names)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=0)


if __name__ == "__main__":
    main()
