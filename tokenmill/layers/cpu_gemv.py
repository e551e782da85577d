"""Small-M fp32 linear kernel for CPU (decode steps of a few tokens); see cpu_gemv_kernel.cpp.

oneDNN's packed GEMM is faster from about M = 12 up; below that the step streams the weights
and this kernel reads them at memory bandwidth (SmolLM2's 120 layer GEMMs at M = 1: oneDNN
26 ms, this kernel 16 ms; M = 4: 36 vs 20 ms; M = 8: 37 vs 32 ms).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.kernels.cpp_build import CpuExtension

GEMV_MAX_ROWS = 8     # the kernel takes steps of at most this many tokens
PANEL = 16            # out_features must be a multiple of this

KERNEL = CpuExtension("tokenmill_cpu_gemv", Path(__file__).with_name("cpu_gemv_kernel.cpp"),
                      ["pack_gemv_weight", "gemv_linear"], "cpu_gemv linear kernel",
                      "oneDNN at every batch size")
load_kernel = KERNEL.load


def gemv_supported(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[0] % PANEL == 0 and load_kernel() is not None)
