"""What device translation costs per call: CUDA calls translated, against torch's own call on the right device.

Each row times single calls in rotating order, one of each per round, with the
translation installed as ``comm.patch()`` installs it: torch's own function (the
object the translation saved) naming this process's device, the call naming CUDA
(translated), the call naming this process's device through the stand-in (what
code that is already right pays), and torch's function again (the A/A control).
Medians; ratios against the first column. Where the translation is not installed
(a CUDA machine, ``--no-devices``) torch's objects are in place and nothing is added.
The ``wrapper`` column is torch's function behind a Python function that only
forwards its arguments: what any Python shim costs here before it does anything.

The last line is the mechanism not chosen: a ``TorchFunctionMode`` sees every torch
call, so even an operator that takes no device pays for it; the translation adds
nothing there (it replaces only the functions that take a device).

Part 1 runs on the simulated NPU (CUDA becomes npu:0), part 2 on a CPU-only process
(CUDA becomes the CPU), each in a fresh process. Part 3 times a whole training step of
``examples/cuda_trainer.py`` (DDP on one CPU rank, so no rank waits for another), translated against the same step with
the translation removed; then callgrind counts its instructions (each side's steps
between marker calls in one process, the A/A control beside them), exact where the
wall clock of a shared machine cannot resolve 1 %.

    python benchmarks/translate.py [--calls N] [--step-instructions STEPS]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from _harness import Call, instructions_by_part, marker, rotate, run_ranks

CALLS = 10000
STEP_INSTRUCTIONS = 100  # training steps per side counted by callgrind
# The training step's sides rotate in blocks of this many counted steps, after this many uncounted.
_BLOCK, _SETTLE = 100, 50
NPU = {"name": "npu", "backend": "hccl"}


def _forwarder(function: Callable[..., Any]) -> Callable[..., Any]:
    """A Python function that only hands its arguments to ``function``: the least any Python shim adds."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)
    return forward


class _ForwardingMode(TorchFunctionMode):
    """The other mechanism: a mode that sees every torch call, here only handing it on."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _cases(device: str) -> List[Tuple[str, Callable[..., Any], Tuple[Any, ...], Call, Call]]:
    """(name, torch's own function, its arguments on ``device``, the CUDA form, the stand-in on ``device``)."""
    from comm.translate.calls import _tensor_to

    zeros = torch.zeros  # torch's own: the translation is not installed yet
    on_device, on_host, big = torch.ones(16, device=device), torch.ones(16), torch.ones(1 << 20)
    as_is = getattr(torch.Tensor, device.split(":")[0])  # Tensor.npu / Tensor.cpu: torch's own Tensor.cuda
    cases = [
        ("torch.zeros(16, device=)", functools.partial(zeros, device=device), (16,),
         lambda: torch.zeros(16, device="cuda:0"), lambda: torch.zeros(16, device=device)),
        ("x.to(device), no copy", _tensor_to, (on_device, device), lambda: on_device.to("cuda:0"),
         lambda: on_device.to(device)),
        ("x.to(device), 16 floats", _tensor_to, (on_host, device), lambda: on_host.to("cuda:0"),
         lambda: on_host.to(device)),
        ("x.cuda()", as_is, (on_host,), lambda: on_host.cuda(), lambda: as_is(on_host)),
    ]
    if device != "cpu":
        cases.insert(3, ("x.to(device), 1 M floats", _tensor_to, (big, device), lambda: big.to("cuda:0"),
                         lambda: big.to(device)))
    return cases


def measure(rank: int, calls: int) -> List[Dict[str, Any]]:
    from comm import translate

    device = "npu:0" if hasattr(torch, "npu") else "cpu"
    cases = _cases(device)
    translate.install()
    rows = []
    for name, function, arguments, cuda_form, installed_right in cases:
        own = functools.partial(function, *arguments)
        floor = functools.partial(_forwarder(function), *arguments)
        medians = rotate([own, cuda_form, installed_right, floor, own], calls)
        reference = medians[0]
        rows.append({"name": name, "torch_us": reference * 1e6, "translated_us": medians[1] * 1e6,
                     "ratio": medians[1] / reference, "installed": medians[2] / reference,
                     "floor": medians[3] / reference, "control": medians[4] / reference})
    translate.uninstall()
    return rows


def mode_cost(rank: int, calls: int) -> Dict[str, float]:
    """An operator that takes no device (x.add(1)), the translation installed: as is, and under a forwarding mode."""
    from comm import translate

    x = torch.ones(16)
    mode = _ForwardingMode()

    def add() -> Any:
        return x.add(1)

    def under_mode() -> Any:
        with mode:
            return x.add(1)

    def mode_alone() -> Any:
        with mode:
            return None

    translate.install()
    medians = rotate([add, under_mode, mode_alone, add], calls)
    translate.uninstall()
    names = ("translation installed (torch's own add)", "forwarding mode", "entering the mode alone", "A/A")
    return dict(zip(names, (m * 1e6 for m in medians)))


def _trainer_steps() -> Tuple[Call, Call]:
    """A step of examples/cuda_trainer.py (DDP on this process's one-rank gloo group), two ways: as written
    (``.cuda(local_rank)``, ``.to(torch.device("cuda", local_rank))``), and naming the CPU."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import cuda_trainer

    model = cuda_trainer.make_model()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=cuda_trainer.LEARNING_RATE)
    dataset = cuda_trainer.make_dataset()
    inputs, targets = dataset.tensors[0][:cuda_trainer.BATCH_SIZE], dataset.tensors[1][:cuda_trainer.BATCH_SIZE]

    def step(on: Any, device: Any) -> None:
        loss = nn.functional.mse_loss(ddp(on(inputs)), targets.to(device, non_blocking=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    cuda = torch.device("cuda", 0)

    def as_written() -> None:
        step(lambda x: x.cuda(0, non_blocking=True), cuda)

    def naming_the_cpu() -> None:
        step(lambda x: x.to("cpu", non_blocking=True), torch.device("cpu"))

    return as_written, naming_the_cpu


def _step_sides() -> List[Tuple[Call, Call]]:
    """(prepare, step) of each side: as written under the translation, then naming the CPU without it (twice,
    the second the A/A control)."""
    from comm import translate

    as_written, naming_the_cpu = _trainer_steps()
    return [(translate.install, as_written), (translate.uninstall, naming_the_cpu),
            (translate.uninstall, naming_the_cpu)]


def training_step(rank: int, calls: int) -> Dict[str, float]:
    """The trainer's step translated, against the step naming the CPU.

    The translated side runs the step as written with the translation installed, as
    ``python -m comm`` runs it; the other sides run the step naming the CPU with the
    translation removed, as ``--no-devices`` leaves torch (the last is the A/A control).
    Installing or removing the translation rewrites attributes of torch's classes, which
    empties Python's attribute caches for them; so the sides rotate in blocks of steps,
    and the first steps after each switch are not counted.
    """
    from comm import translate

    sides = _step_sides()
    times: List[List[float]] = [[] for _ in sides]
    for round_ in range(max(calls // _BLOCK, 1)):
        for offset in range(len(sides)):
            which = (round_ + offset) % len(sides)
            prepare, side = sides[which]
            prepare()
            for index in range(_SETTLE + _BLOCK):
                start = time.perf_counter()
                side()
                if index >= _SETTLE:
                    times[which].append(time.perf_counter() - start)
    translate.uninstall()
    medians = [statistics.median(t) for t in times]
    return {"under -m comm us": medians[0] * 1e6, "--no-devices us": medians[1] * 1e6,
            "ratio": medians[0] / medians[1], "A/A": medians[2] / medians[1]}


def _count_steps(steps: int) -> None:
    """The process callgrind counts: each side's ``steps`` steps, after ``_SETTLE`` uncounted, between markers."""
    from comm import translate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for prepare, side in _step_sides():
        prepare()
        for _ in range(_SETTLE):
            side()
        marker()
        for _ in range(steps):
            side()
        marker()
    translate.uninstall()
    dist.destroy_process_group()


def step_instructions(steps: int) -> Optional[Dict[str, float]]:
    """Instructions per step of each side (callgrind; None where valgrind is not installed).

    The parts after the first marker: the first side's counted steps, the next side's
    switch and settling steps, its counted steps, and so on.
    """
    totals = instructions_by_part(str(Path(__file__).resolve()), "--count-steps", str(steps), parts=5)
    if totals is None:
        return None
    translated, cpu, again = (totals[i] / steps for i in (0, 2, 4))
    return {"under -m comm": translated, "--no-devices": cpu, "ratio": translated / cpu, "A/A": again / cpu}


def _print(title: str, rows: List[Dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'call':<26} {'torch us':>9} {'translated us':>14} {'ratio':>6} {'right device':>13} {'wrapper':>8} "
          f"{'A/A':>6}")
    for row in rows:
        print(f"{row['name']:<26} {row['torch_us']:>9.2f} {row['translated_us']:>14.2f} {row['ratio']:>6.3f} "
              f"{row['installed']:>13.3f} {row['floor']:>8.3f} {row['control']:>6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per side")
    parser.add_argument("--step-instructions", type=int, default=STEP_INSTRUCTIONS, metavar="STEPS",
                        help="steps per side counted by callgrind (0: none)")
    parser.add_argument("--count-steps", type=int, help=argparse.SUPPRESS)  # the process callgrind runs
    args = parser.parse_args()
    if args.count_steps is not None:
        _count_steps(args.count_steps)
        return
    print(f"torch {torch.__version__}; medians of single calls in rotating order; ratio = translated / torch, "
          "A/A = torch again / torch")
    body = functools.partial(measure, calls=args.calls)
    _print(f"Simulated NPU: 'cuda:0' translated to npu:0, {args.calls} calls per side",
           run_ranks(body, world_size=1, simulate=NPU))
    _print(f"CPU-only: 'cuda:0' translated to the CPU, {args.calls} calls per side", run_ranks(body, world_size=1))
    costs = run_ranks(functools.partial(mode_cost, calls=args.calls), world_size=1)
    print(f"\nx.add(1), an operator that takes no device, {args.calls} calls per side: "
          + ", ".join(f"{name} {us:.2f} us" for name, us in costs.items()))
    steps = max(args.calls // 5, 100)
    trained = run_ranks(functools.partial(training_step, calls=steps), world_size=1)
    print(f"\nA step of examples/cuda_trainer.py, DDP on one gloo rank, CPU-only, {steps} steps per side: "
          + ", ".join(f"{name} {value:.3f}" for name, value in trained.items()))
    if args.step_instructions:
        counted = step_instructions(args.step_instructions)
        shown = "skipped, valgrind is not installed" if counted is None else ", ".join(
            f"{name} {value:,.0f}" if value > 10 else f"{name} {value:.4f}" for name, value in counted.items())
        print(f"The same step, instructions (callgrind, {args.step_instructions} steps per side): {shown}")


if __name__ == "__main__":
    main()
