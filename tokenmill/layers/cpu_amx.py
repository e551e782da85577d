"""fp32 linear on the AMX bf16 tile unit for prefill steps and, with GGUF Q4_1 or Q8_0
weights, decode steps of 12 rows or more; see cpu_amx_kernel.cpp.

Weights that are exactly GGUF Q4_1 values (d q + m a block of 32 inputs) are kept as their
levels in four bits, with each block's d and m, in one run of records a column group (rebuilt
as bf16 tiles in L1: the factored form, three tile products a block), Q8_0 values (d q) the
same way with their levels a byte each and d; other weights that are exactly two bf16 numbers
each (hi + lo: fp16 or bf16 checkpoints) as hi and lo tiles (five). The step's input is split
into three bf16 numbers a value, and the tile unit sums exact products in fp32: as accurate as
an fp32 GEMM, in another order.
Other weights, and CPUs without AMX, keep oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.kernels.cpp_build import ENTRY_POINTS, WORK_SHARING, CpuExtension
from tokenmill.kernels.huge_pages import to_huge_pages
from tokenmill.layers.cpu_gemv import BLOCK_FORMATS

# The fewest rows the tiles take where the small-M kernel's compact panels also could: below,
# the tiles' 4 bytes a weight streamed from memory cost more than the panels' FMAs. SmolLM2's
# 120 layer linears on a 2-core Sapphire Rapids-class Xeon, compact panels against tiles,
# paired medians: M = 32: 0.91x, 48: 0.94x, 64: 0.87x, 96: 1.27x, 128: 1.32x.
AMX_MIN_ROWS = 80
# The same for Q4_1 weights in the factored form (three products a block; up to 16 rows from
# four-bit levels rebuilt in L1), in the C++ layer loop as in the modules. Whole 30-layer
# decode steps (short contexts) against compact panels, paired medians of 6, thirtieth
# session: 8 rows 0.87x, 12 rows 1.15x, 16 rows 1.13x (docs/benchmarks.md).
AMX_Q4_1_MIN_ROWS = 12
# Q8_0 weights (the default model's tied lm_head, 49152 x 576) against the compact Q8_0
# panels, medians of 21 alternating calls, thirtieth session: M = 4: 0.52x, 8: 0.99x, 12:
# 1.34x, 16: 1.80x, 32: 1.79x, 64: 1.94x. On the 400 GFLOP/s Xeon (forty-third session), with
# the caches flushed between calls as a decode step's other reads flush them, medians of 25:
# 11 rows 3.22 ms on the tiles against 2.71 on the panels, 12 rows 3.32 against 2.93, 13 rows
# 3.36 against 4.01 (a second row group); warm, 12 rows were even (2.65, 2.67).
# The Q8_0 records (levels a byte each, forty-sixth session) took the lm_head at 13-16 rows
# from 3.27-3.57 to 2.77-3.21 ms in real decode steps; at 10-12 rows the panels stayed as fast
# or faster (12 rows 2.99 / 2.80 ms against 3.16 / 2.83 on the tiles).
AMX_Q8_0_MIN_ROWS = 13

KERNEL = CpuExtension("tokenmill_cpu_amx", Path(__file__).with_name("cpu_amx_kernel.cpp"),
                      ["amx_available", "pack_amx_weight", "amx_linear", "pack_amx_q4_1",
                       "pack_amx_q8_0", "amx_linear_factored", "entry_points"], "AMX linear kernel",
                      "oneDNN for long steps", headers=(ENTRY_POINTS, WORK_SHARING, BLOCK_FORMATS))


_NONE = torch.empty(0)


@dataclass(frozen=True)
class AmxWeight:
    """A weight on the tiles, factored: the column groups' records (Q4_1: the levels in four
    bits with their blocks' steps and minimums; Q8_0: the levels a byte each with their steps;
    one stream a group; `tiles` empty), with the steps (and Q4_1's minimums) also apart (they
    give the kernel the shape); or (steps None) hi + lo bf16 tiles."""
    tiles: torch.Tensor
    steps: torch.Tensor | None = None
    mins: torch.Tensor | None = None      # Q4_1 only
    records: torch.Tensor | None = None   # factored only

    def factored_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """levels (the records), steps and minimums (empty for Q8_0)."""
        return (self.records if self.records is not None else self.tiles, self.steps,
                self.mins if self.mins is not None else _NONE)

    @property
    def min_rows(self) -> int:
        """The fewest rows of a step that it takes rather than the small-M kernel's panels."""
        if self.steps is None:
            return AMX_MIN_ROWS
        return AMX_Q4_1_MIN_ROWS if self.mins is not None else AMX_Q8_0_MIN_ROWS


def load_kernel() -> ModuleType | None:
    """The kernel module where this CPU has AMX tiles and the OS grants them, else None."""
    module = KERNEL.load()
    return module if module is not None and module.amx_available() else None


def pack_amx_weight(weight: torch.Tensor, factored: bool = True) -> AmxWeight | None:
    """The weight on the tiles (in the factored form where it holds Q4_1 or Q8_0 values,
    unless not `factored`), or None where the kernel cannot take it exactly (a weight neither
    Q4_1, Q8_0 nor two bf16 numbers, a shape not in whole tiles, no AMX)."""
    kernel = load_kernel()
    if kernel is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    packers = (kernel.pack_amx_q4_1, kernel.pack_amx_q8_0)
    for pack in packers if factored else ():
        if parts := pack(weight, False):   # levels as records only (no bf16 tiles)
            tiles, steps, mins, records = (_streamed(part) for part in parts)
            return AmxWeight(tiles, steps, mins if mins.numel() else None, records)
    packed = kernel.pack_amx_weight(weight)
    return AmxWeight(_streamed(packed)) if packed.numel() else None


def _streamed(part: torch.Tensor | None) -> torch.Tensor | None:
    """A packed part on huge pages: the steps stream it whole (kernels/huge_pages.py)."""
    return part if part is None or not part.numel() else to_huge_pages(part)


def amx_linear(x: torch.Tensor, weight: AmxWeight) -> torch.Tensor:
    """x [M, K] (contiguous fp32) @ the packed weight's [N, K]^T."""
    kernel = load_kernel()
    if weight.steps is not None:
        return kernel.amx_linear_factored(x, *weight.factored_operands())
    return kernel.amx_linear(x, weight.tiles)
