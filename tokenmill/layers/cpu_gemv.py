"""Small-M fp32 linear kernel for CPU (decode-sized steps); see cpu_gemv_kernel.cpp.

Weights that are exactly Q4_1 or Q8_0 values (as a GGUF model of those types loads) can also
stream as compact panels, which the kernel rebuilds as the same fp32 values: bitwise the same
output for a sixth (Q4_1) or 27% (Q8_0) of the bytes (their blocks' scales in fp16, as GGUF
keeps them). Short steps take the factored form instead (d (q . x) + m sum(x) a block, Q8_0
without m; no weight rebuilt): up to 6 rows where the build has AVX-512 (gemv_avx512.h), one
row on the AVX2 tiles; as accurate, not bitwise; `gemv_use_factored(False)` switches it off
(`gemv_factored_max_rows()` tells the route's limit).

SmolLM2's 120 layer GEMMs (distinct weights, so they stream from memory), best of several
runs, oneDNN's packed GEMM -> this kernel: M = 1: 20 -> 14 ms (memory bandwidth); M = 8:
30 -> 22 ms; M = 16: 46 -> 30 ms; M = 32: 68 -> 50 ms; M = 64: 133 -> 110 ms; M = 128:
219 -> 190 ms; M = 256: even (390 ms). Since the threads take the panels in chunks
(kernels/work_sharing.h), the 120 GEMMs against oneDNN, medians, same process: M = 128:
173 -> 204 ms (157 against 133 GFLOP/s); M = 256: 374 -> 404; M = 384: 607 -> 663; M = 512:
even; M = 1024: oneDNN 3% faster. With a busy-loop competitor on one core (2 ms of every 10),
M = 256: 410 against 456 ms. Those figures are from an AVX2 machine, with the AVX2 tiles;
where the build has AVX-512, its own tiles (gemv_avx512.h) take the steps, bitwise the same.
Above GEMV_MAX_ROWS (see gemv_max_rows) oneDNN takes the step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.kernels.cpp_build import ENTRY_POINTS, WORK_SHARING, CpuExtension


def gemv_max_rows(capability: str) -> int:
    """The longest step the kernel takes (oneDNN the longer ones) on a CPU of ATen's
    `capability`. SmolLM2's 120 layer GEMMs on a 2-core Xeon, this kernel's AVX-512 tiles
    against oneDNN: M = 32: 31.6 against 43.8 ms; M = 96: 82.7 against 91.2; M = 128: even
    (106 against 110, then 108 against 108); M = 192: 166 against 146. On an AVX2 machine its
    AVX2 tiles beat oneDNN up to 384 rows."""
    return 128 if capability.startswith("AVX512") else 384


def gemv_compact_max_rows(capability: str) -> dict[torch.dtype, int]:
    """The longest step that takes compact panels (gemv_blocks.h) by their dtype; above it the
    FMAs bound both kinds and the compact ones pay for rebuilding the weights.

    AVX2, streamed from memory, fp32 -> compact panels:
    - SmolLM2's 210 layer linears (Q4_1): M = 1: 13.3 -> 5.1 ms; M = 2: 13.7 -> 6.6; M = 4:
      16.0 -> 8.1; M = 8: 17.7 -> 15.6; M = 10: 18.5-20.5 -> 17.5-18.6; M = 12 even.
    - its lm_head (Q8_0): M = 1: 4.0 -> 1.4 ms; M = 4: 4.5 -> 2.5. From 7 rows the Q8_0
      panels run in half-panel tiles (cpu_gemv_kernel.cpp), medians of 9, same process:
      M = 7: 4.76 -> 3.83 ms; M = 8: 5.01 -> 4.27; M = 10: 4.51 -> 4.45; M = 12: 6.13 -> 5.60.
    AVX-512 tiles (2-core Xeon), where more than 12 rows rebuild the weights once per slice
    into L1 (gemv_avx512.h), so the compact panels win at every M the kernel takes. Best of 7,
    the 120 layer GEMMs (Q4_1): M = 8: 15.6 -> 9.5 ms; M = 16: 20.8 -> 17.5; M = 32: 29.8 ->
    27.8-29.0; M = 64: 51.3-55.1 -> 49.7-51.7; M = 96: 82.6 -> 72.2; M = 128: 103.6 -> 97.3.
    The lm_head (Q8_0), best of 9: M = 16: 4.17 -> 3.34 ms; M = 32: 7.33 -> 6.58; M = 128:
    24.7 -> 23.2."""
    if capability.startswith("AVX512"):
        rows = gemv_max_rows(capability)
        return {torch.uint8: rows, torch.int8: rows}
    return {torch.uint8: 10, torch.int8: 12}


_CAPABILITY = torch.backends.cpu.get_cpu_capability()
GEMV_MAX_ROWS = gemv_max_rows(_CAPABILITY)
GEMV_COMPACT_MAX_ROWS = gemv_compact_max_rows(_CAPABILITY)
PANEL = 16            # out_features must be a multiple of this

BLOCK_FORMATS = Path(__file__).with_name("gemv_blocks.h")   # the compact panels
ROW_GROUPS = Path(__file__).with_name("gemv_rows.h")       # shared by both tile sets
AVX512_TILES = Path(__file__).with_name("gemv_avx512.h")
KERNEL = CpuExtension("tokenmill_cpu_gemv", Path(__file__).with_name("cpu_gemv_kernel.cpp"),
                      ["pack_gemv_weight", "pack_gemv_q4", "pack_gemv_q8", "gemv_linear",
                       "compact_panel_rows", "gemv_use_avx512", "gemv_use_factored",
                       "gemv_factored_max_rows", "entry_points"], "cpu_gemv linear kernel",
                      "oneDNN at every batch size",
                      headers=(ENTRY_POINTS, WORK_SHARING, BLOCK_FORMATS, ROW_GROUPS,
                               AVX512_TILES))
load_kernel = KERNEL.load


def gemv_supported(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[0] % PANEL == 0 and load_kernel() is not None)
