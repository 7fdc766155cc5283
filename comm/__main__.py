"""``python -m comm``: run a script or module with torch patched to use comm.

    python -m comm [--no-devices] [--simulate npu] script.py [args...]
    python -m comm [--no-devices] [--simulate npu] -m package.module [args...]
    torchrun --nproc-per-node 2 -m comm train.py --lr 1e-3
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

import comm

USAGE = """usage: python -m comm [--no-devices] script.py [args...]
       python -m comm [--no-devices] -m module [args...]
       (--simulate NAME goes before the script too)

Runs the script or module as __main__, with its own arguments, after comm.patch():
every process group gets comm's staging backend for the devices its own backend
does not serve, so every collective and point-to-point call on a tensor there
(from torch.distributed, DTensor, DDP, FSDP, DCP, torch.nn.utils.clip_grad_norm_)
is staged onto one it does. In a process without CUDA, CUDA-only
calls (torch.cuda.set_device, .cuda(), "cuda" devices, "nccl") act on this
process's accelerator, or on the CPU where there is none.

options:
  --no-clip        accepted for older command lines; torch's clip_grad_norm_ is
                   left as it is in any case
  --no-devices     translate no CUDA call (COMM_TRANSLATE=0 does the same)
  --simulate NAME  run on the simulated accelerator NAME (npu, or npu:hccl), as
                   COMM_SIMULATE=NAME does; spawned children simulate it too
  -m MODULE        run a module, as python -m does
  -h, --help       show this message"""


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    devices = True
    while args and args[0] in ("--no-clip", "--no-devices", "--simulate", "-h", "--help"):
        option = args.pop(0)
        if option == "--no-clip":
            print("python -m comm: --no-clip is no longer needed: torch's clip_grad_norm_ is never replaced",
                  file=sys.stderr)
        elif option == "--no-devices":
            devices = False
            os.environ["COMM_TRANSLATE"] = "0"  # for children patched at their import as well
        elif option == "--simulate":
            if not args:
                sys.exit("python -m comm: --simulate needs an accelerator name, such as npu")
            os.environ["COMM_SIMULATE"] = args.pop(0)  # for spawned children as well
            from comm.testing import simulate_from_environment

            simulate_from_environment()
        else:
            print(USAGE)
            return
    if not args:
        sys.exit(f"python -m comm: expected a script or -m module to run\n\n{USAGE}")
    check_target("python -m comm", args)
    comm.patch(devices=devices)
    run_target(args)


def check_target(program: str, args: List[str]) -> None:
    """Exit, saying why, unless ``args`` names a script that exists or ``-m`` and a module."""
    if args[0] == "-m" and len(args) < 2:
        sys.exit(f"{program}: -m needs a module name")
    if args[0] != "-m" and not os.path.isfile(args[0]):
        sys.exit(f"{program}: can't open file {args[0]!r}: no such file")


def run_target(args: List[str]) -> None:
    """Run the script ``args[0]`` (or the module after ``-m``) as ``__main__``, with the rest as its arguments."""
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")

if __name__ == "__main__":
    main()
