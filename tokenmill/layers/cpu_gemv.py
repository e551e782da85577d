"""Small-M fp32 linear kernel for CPU (decode-sized steps); see cpu_gemv_kernel.cpp.

SmolLM2's 120 layer GEMMs (distinct weights, so they stream from memory), best of several
runs, oneDNN's packed GEMM -> this kernel: M = 1: 20 -> 14 ms (memory bandwidth); M = 8:
30 -> 22 ms; M = 16: 46 -> 30 ms; M = 32: 68 -> 50 ms; M = 64: 133 -> 110 ms; M = 128:
219 -> 190 ms; M = 256: even (390 ms). Above GEMV_MAX_ROWS oneDNN takes the step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.kernels.cpp_build import ENTRY_POINTS, CpuExtension

GEMV_MAX_ROWS = 128   # the kernel takes steps of at most this many tokens
PANEL = 16            # out_features must be a multiple of this

KERNEL = CpuExtension("tokenmill_cpu_gemv", Path(__file__).with_name("cpu_gemv_kernel.cpp"),
                      ["pack_gemv_weight", "gemv_linear", "entry_points"], "cpu_gemv linear kernel",
                      "oneDNN at every batch size", headers=(ENTRY_POINTS,))
load_kernel = KERNEL.load


def gemv_supported(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[0] % PANEL == 0 and load_kernel() is not None)
