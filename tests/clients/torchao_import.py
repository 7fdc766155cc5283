"""Imports torchao as torchtitan's float8 and MX converters do; its MoE kernels probe CUDA's capability at import."""

import torch
import torchao
import torchao.float8
import torchao.prototype.moe_training
import torchao.prototype.mx_formats


def main() -> None:
    """Print what torchao saw: its release and whether CUDA looked available."""
    modules = [torchao.float8, torchao.prototype.mx_formats, torchao.prototype.moe_training]
    print(f"torchao {torchao.__version__} imported {len(modules)} modules; cuda available {torch.cuda.is_available()}",
          flush=True)


if __name__ == "__main__":
    main()
