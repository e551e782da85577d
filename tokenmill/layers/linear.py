"""Linear layers. Weights are [out_features, in_features], as in Hugging Face checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one GEMM (q|k|v, gate|up).

    `load_shard(index, w)` fills the rows of part `index`; fewer, larger GEMMs are faster on
    CPU than three small ones.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(part_sizes), bias)
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]

    def load_shard(self, index: int, weight: torch.Tensor, is_bias: bool = False) -> None:
        start, size = self.part_offsets[index], self.part_sizes[index]
        target = self.bias if is_bias else self.weight
        assert target is not None, "checkpoint has a bias this layer does not"
        assert weight.shape[0] == size, f"part {index}: {tuple(weight.shape)} rows != {size}"
        target.data[start:start + size].copy_(weight)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.part_sizes, dim=-1)
