"""Fused kernels for CPU fp32: residual add + RMSNorm, rotary, SiLU·mul, and the greedy pick
(argmax_rows); see cpu_fused_kernel.cpp. Each replaces a chain of small torch ops whose
dispatch cost (and passes over memory) dominate at decode sizes."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.kernels.cpp_build import AVX2_MATH, ENTRY_POINTS, CpuExtension

KERNEL = CpuExtension("tokenmill_cpu_fused", Path(__file__).with_name("cpu_fused_kernel.cpp"),
                      ["add_rms_norm", "rotate_half", "silu_and_mul", "argmax_rows",
                       "entry_points"],
                      "cpu_fused elementwise kernels", "torch ops",
                      extra_cflags=("-ffp-contract=off",), headers=(AVX2_MATH, ENTRY_POINTS))
load_kernel = KERNEL.load


ELEMENTWISE_BACKENDS = ("auto", "torch", "cpu_fused")


def resolve_elementwise_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": "cpu_fused" for float32 on CPU when the kernels compile, else "torch"."""
    if name not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"elementwise_backend: unknown backend {name!r} "
                         f"(known: {', '.join(ELEMENTWISE_BACKENDS)})")
    fits = torch.device(device).type == "cpu" and dtype == torch.float32
    if name == "auto":
        return "cpu_fused" if fits and load_kernel() is not None else "torch"
    if name == "cpu_fused" and not fits:
        raise ValueError(f"elementwise_backend: 'cpu_fused' needs float32 on CPU, got {dtype} "
                         f"on {torch.device(device).type}")
    if name == "cpu_fused" and load_kernel() is None:
        raise ValueError("elementwise_backend: 'cpu_fused' needs the cpu_fused kernels, which "
                         "did not compile (see the warning above)")
    return name


def enable_fused_elementwise(model: torch.nn.Module) -> int:
    """Point every RMSNorm, RotaryEmbedding and SiluAndMul in `model` at the kernels; returns
    how many."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import RotaryEmbedding
    modules = [m for m in model.modules()
               if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul))]
    for module in modules:
        module.kernel = load_kernel()
    return len(modules)
