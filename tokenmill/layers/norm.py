"""RMSNorm with the residual add fused in (the pre-norm transformer's two hot elementwise ops).

`kernel` (layers/cpu_fused.py, set by the loader for the "cpu_fused" elementwise backend) does
both in one pass; the torch ops below are the reference."""

from __future__ import annotations

import torch
from torch import nn


_NO_RESIDUAL = torch.empty(0)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernel = None  # the cpu_fused module, when enabled

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [num_tokens, hidden]. Returns (normed, new residual = x + residual)."""
        if self.kernel is not None:
            normed, summed = self.kernel.add_rms_norm(
                x.contiguous(), _NO_RESIDUAL if residual is None else residual.contiguous(),
                self.weight, self.eps)
            return normed, summed
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:  # one fused op, bitwise equal to the steps below
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype), x
