"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate | up) -> [num_tokens, d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu_and_mul, or one pass of the cpu_fused kernel when `kernel` is set (by
    layers/cpu_fused.enable_fused_elementwise); the torch ops are the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.silu_and_mul(gate_up.contiguous())
        return silu_and_mul(gate_up)
