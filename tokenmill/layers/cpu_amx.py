"""fp32 linear on the AMX bf16 tile unit for long (prefill) steps; see cpu_amx_kernel.cpp.

Weights that are exactly two bf16 numbers each (hi + lo: what a GGUF Q4_1 model loads as, and
fp16 or bf16 checkpoints) are kept as bf16 tiles; the step's input is split into three bf16
numbers a value, and the tile unit sums exact products in fp32: as accurate as an fp32 GEMM,
in another order. Other weights, and CPUs without AMX, keep oneDNN.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from tokenmill.kernels.cpp_build import WORK_SHARING, CpuExtension

# The fewest rows the tiles take where the small-M kernel's compact panels also could: below,
# the tiles' 4 bytes a weight streamed from memory cost more than the panels' FMAs. SmolLM2's
# 120 layer linears on a 2-core Sapphire Rapids-class Xeon, compact panels against tiles,
# paired medians: M = 32: 0.91x, 48: 0.94x, 64: 0.87x, 96: 1.27x, 128: 1.32x.
AMX_MIN_ROWS = 80

KERNEL = CpuExtension("tokenmill_cpu_amx", Path(__file__).with_name("cpu_amx_kernel.cpp"),
                      ["amx_available", "pack_amx_weight", "amx_linear"], "AMX linear kernel",
                      "oneDNN for long steps", headers=(WORK_SHARING,))


def load_kernel() -> ModuleType | None:
    """The kernel module where this CPU has AMX tiles and the OS grants them, else None."""
    module = KERNEL.load()
    return module if module is not None and module.amx_available() else None


def pack_amx_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as bf16 tiles, or None where the kernel cannot take it exactly (a weight not
    two bf16 numbers, a shape not in whole tiles, no AMX)."""
    kernel = load_kernel()
    if kernel is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    packed = kernel.pack_amx_weight(weight)
    return packed if packed.numel() else None
