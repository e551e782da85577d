"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama checkpoints)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3", "freq_factors")


def _inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    ramp = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # ramp 0: long wavelength (scaled), ramp 1: short wavelength (kept).
    return (1 - ramp) * inv_freq / factor + ramp * inv_freq


def rope_inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = _inverse_frequencies(head_dim, base)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if kind == "freq_factors":  # GGUF Llama 3.x: the divisors themselves are stored
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported "
                     f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)})")


class RopeTables(NamedTuple):
    """One step's cos/sin rows ([num_tokens, 1, head_dim]) and the kernel to apply them with
    (None: the torch ops of `_rotate`, the reference)."""
    cos: torch.Tensor
    sin: torch.Tensor
    kernel: Any = None


class RotaryEmbedding(nn.Module):
    """cos/sin tables over all positions. A forward pass looks its positions up once
    (`tables`) and every layer applies them (`apply`): no per-layer gathers."""

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim]: each frequency twice, for the rotate-half layout
        self.register_buffer("cos", freqs.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", freqs.sin().repeat(1, 2), persistent=False)
        self.kernel = None  # the cpu_fused module, when enabled: rotate in one pass

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions: [num_tokens] -> cos, sin: [num_tokens, 1, head_dim] in `dtype`."""
        def rows(table: torch.Tensor) -> torch.Tensor:   # index_select: half the dispatch cost
            picked = table.index_select(0, positions).unsqueeze(1)
            return picked if picked.dtype == dtype else picked.to(dtype)
        return RopeTables(rows(self.cos), rows(self.sin), self.kernel)

    @staticmethod
    def rotate(tables: RopeTables, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, any heads, head_dim]."""
        if tables.kernel is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            num_tokens, head_dim = tables.cos.shape[0], tables.cos.shape[2]
            return tables.kernel.rotate_half(x, tables.cos.view(num_tokens, head_dim),
                                             tables.sin.view(num_tokens, head_dim))
        return _rotate(x, tables.cos, tables.sin)

    @staticmethod
    def apply(tables: RopeTables, q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]."""
        return RotaryEmbedding.rotate(tables, q), RotaryEmbedding.rotate(tables, k)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(self.tables(positions, q.dtype), q, k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
