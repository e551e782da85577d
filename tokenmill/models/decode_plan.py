"""DecodePlan: the decoder layers of a Llama-family model for a decode-only step, as one flat
loop over the CPU kernels, run in C++ (decode_plan_kernel.cpp).

At batch 1 the module path spent about 3 ms of a 27 ms token in Python: ten nn.Module calls
per layer, the attention backend's general bookkeeping (prefill spans, a copy into a shared
output) and their small tensor ops. A flat Python loop over the kernels still made some 600
dispatches a token. The plan keeps each layer's kernel-ready weights and calls the same
kernels, in the same order, on the same tensors, so its output is bitwise that of the module
path (test_decode_plan_is_bitwise_the_module_path in tests/model/test_fast_paths.py).
Each linear runs as the module would for the step's size: the small-M kernel's panels, or
GGUF Q4_1 (Q8_0) weights on the AMX tiles from their min_rows (layers/cpu_amx.py). Steps with a
prefill chunk, or more tokens than the small-M kernel takes (or than other AMX tiles, hi + lo,
take faster), go through the modules, and so does every step when a kernel cannot be built.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
from torch import nn

from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.metadata import AttentionMetadata, ForwardContext
from tokenmill.kernels.cpp_build import ENTRY_POINTS, CpuExtension
from tokenmill.layers import cpu_amx
from tokenmill.layers.cpu_gemv import GEMV_MAX_ROWS
from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel
from tokenmill.layers.linear import Linear
from tokenmill.layers.rotary import RopeTables

LOOP = CpuExtension("tokenmill_decode_plan", Path(__file__).with_name("decode_plan_kernel.cpp"),
                    ["decode_layers"], "C++ decode loop", "the layer modules",
                    headers=(ENTRY_POINTS,), keep_gil=("decode_layers",))  # it lets go itself


_NONE = torch.empty(0)


def _on_tiles(linear: Linear, num_tokens: int) -> bool:
    """Whether the module takes a step this long on factored (Q4_1 or Q8_0) tiles
    (Linear.forward)."""
    tiles = linear.amx_weight
    return tiles is not None and tiles.steps is not None and num_tokens >= tiles.min_rows


def _linear_weights(linear: Linear, num_tokens: int) -> list[torch.Tensor]:
    """The three tensors decode_layers takes for a linear: its tiles' levels, steps and
    minimums, or its cpu_gemv panels for the step's size and two empty tensors."""
    if _on_tiles(linear, num_tokens):
        return list(linear.amx_weight.factored_operands())
    return [linear.small_step_panels(num_tokens), _NONE, _NONE]


class _Layer(NamedTuple):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None   # only q|k|v has a bias
    o: Linear
    gate_up: Linear
    down: Linear

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def weights(self, num_tokens: int) -> list[torch.Tensor]:
        """The 15 tensors decode_layers takes for this layer (no bias: an empty tensor)."""
        bias = self.qkv_bias if self.qkv_bias is not None else _NONE
        return [self.input_norm, self.post_norm, bias,
                *(t for m in self.linears for t in _linear_weights(m, num_tokens))]


class DecodePlan:
    def __init__(self, layers: list[_Layer], eps: float, heads: int, kv_heads: int,
                 scale: float, loop: ModuleType, kernel_entry_points: list[object]) -> None:
        self.layers = layers
        self.num_layers = len(layers)
        hi_lo = [m.amx_weight.min_rows for layer in layers for m in layer.linears
                 if m.amx_weight is not None and m.amx_weight.steps is None]
        # GEMV_MAX_ROWS, or fewer where hi + lo tiles (which the loop has no kernel for) take
        # shorter steps faster
        self.max_tokens = min([GEMV_MAX_ROWS, *(rows - 1 for rows in hi_lo)])
        # decode_layers takes one flat list, 15 per layer; the linears' weights depend on the
        # step's size (compact panels for the fewest tokens, tiles for the most), so one list
        # per size, made once
        self._weights_by_size: dict[int, list[torch.Tensor]] = {}
        self.eps, self.heads, self.kv_heads, self.scale = eps, heads, kv_heads, scale
        self.loop, self.entry_points = loop, kernel_entry_points

    @classmethod
    def build(cls, layers: nn.ModuleList) -> DecodePlan | None:
        """The plan for `layers` (LlamaDecoderLayer), or None unless every part of them runs
        on the CPU kernels: cpu_fused norms and rotary, cpu_gemv linears ("hybrid"), the
        cpu_paged attention kernel, and the C++ loop over them builds."""
        plan_layers = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            fused = (layer.input_layernorm.kernel, layer.post_attention_layernorm.kernel,
                     mlp.act.kernel)
            if (not all(m.has_gemv_panels for m in linears) or any(k is None for k in fused)
                    or not isinstance(attn.backend, CpuPagedBackend)
                    or attn.backend.kernel is None):
                return None
            plan_layers.append(_Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                linears[0], attn.qkv_proj.bias, *linears[1:]))
        loop = LOOP.load()
        if loop is None:
            return None
        first = layers[0]
        attn = first.self_attn
        kernels = [first.input_layernorm.kernel, load_gemv_kernel(), attn.backend.kernel]
        if any(_on_tiles(m, GEMV_MAX_ROWS) for layer in plan_layers for m in layer.linears):
            kernels.append(cpu_amx.load_kernel())   # it packed them, so it loads
        return cls(plan_layers, first.input_layernorm.eps, attn.num_heads, attn.num_kv_heads,
                   attn.backend.scale, loop, [e for k in kernels for e in k.entry_points()])

    def weights(self, num_tokens: int) -> list[torch.Tensor]:
        if num_tokens > GEMV_MAX_ROWS:   # the linears may have no panels for such a step
            raise ValueError(f"decode plan: {num_tokens} tokens, more than the "
                             f"{GEMV_MAX_ROWS} its kernels take")
        weights = self._weights_by_size.get(num_tokens)
        if weights is None:
            weights = [t for layer in self.layers for t in layer.weights(num_tokens)]
            self._weights_by_size[num_tokens] = weights
        return weights

    def accepts(self, num_tokens: int, rope: RopeTables, ctx: ForwardContext) -> bool:
        """A decode-only step the kernels take: at most max_tokens, fp32 caches and the
        rotary kernel in the step's tables."""
        meta = ctx.attn
        return (not meta.prefills and meta.num_decodes == num_tokens <= self.max_tokens
                and rope.kernel is not None and ctx.kv_caches[0][0].dtype == torch.float32)


    def run(self, hidden: torch.Tensor, rope: RopeTables, ctx: ForwardContext
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden_size] embeddings -> (last layer's output, residual),
        as the layer loop of LlamaModel.forward leaves them."""
        n = hidden.shape[0]
        meta: AttentionMetadata = ctx.attn
        dim = rope.cos.shape[-1]
        window = -1 if meta.sliding_window is None else meta.sliding_window
        caches = [c for kv in ctx.kv_caches[:self.num_layers] for c in kv]
        hidden, residual = self.loop.decode_layers(
            hidden, self.weights(n), caches, rope.cos.view(n, dim), rope.sin.view(n, dim),
            meta.slot_mapping, meta.decode_block_table, meta.decode_seq_lens, self.eps,
            self.heads, self.kv_heads, self.scale, window, self.entry_points)
        return hidden, residual
