"""DecodePlan: the decoder layers of a Llama-family model for a decode-only step, as one flat
loop over the CPU kernels.

At batch 1 the module path spent about 3 ms of a 27 ms token in Python: ten nn.Module calls
per layer, the attention backend's general bookkeeping (prefill spans, a copy into a shared
output) and their small tensor ops. The plan keeps each layer's kernel-ready weights and calls
the same kernels, in the same order, on the same tensors, so its output is bitwise that of the
module path (test_decode_plan_is_bitwise_the_module_path in tests/model/test_fast_paths.py).
Steps with a prefill chunk, or more tokens than the small-M linear kernel takes, go through
the modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.attention.metadata import AttentionMetadata, ForwardContext
from tokenmill.attention.torch_ref import write_kv
from tokenmill.layers.cpu_gemv import GEMV_MAX_ROWS
from tokenmill.layers.cpu_gemv import load_kernel as load_gemv_kernel
from tokenmill.layers.rotary import RopeTables


class _LayerWeights(NamedTuple):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor            # cpu_gemv panels of each linear (only q|k|v has a bias)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecodePlan:
    def __init__(self, layers: list[_LayerWeights], eps: float, heads: int, kv_heads: int,
                 head_dim: int, scale: float, kernels: tuple) -> None:
        self.layers = layers
        self.eps = eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = scale
        self.fused, self.gemv, self.attention = kernels

    @classmethod
    def build(cls, layers: nn.ModuleList) -> DecodePlan | None:
        """The plan for `layers` (LlamaDecoderLayer), or None unless every part of them runs
        on the CPU kernels: cpu_fused norms and rotary, cpu_gemv linears ("hybrid"), the
        cpu_paged attention kernel."""
        weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = tuple(m.gemv_weight for m in (attn.qkv_proj, attn.o_proj,
                                                    mlp.gate_up_proj, mlp.down_proj))
            fused = (layer.input_layernorm.kernel, layer.post_attention_layernorm.kernel,
                     mlp.act.kernel)
            if (any(p is None for p in linears) or any(k is None for k in fused)
                    or not isinstance(attn.backend, CpuPagedBackend)
                    or attn.backend.kernel is None):
                return None
            weights.append(_LayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                linears[0], attn.qkv_proj.bias, *linears[1:]))
        first = layers[0]
        attn = first.self_attn
        return cls(weights, first.input_layernorm.eps, attn.num_heads, attn.num_kv_heads,
                   attn.head_dim, attn.backend.scale,
                   (first.input_layernorm.kernel, load_gemv_kernel(), attn.backend.kernel))

    def accepts(self, num_tokens: int, rope: RopeTables, ctx: ForwardContext) -> bool:
        """A decode-only step the kernels take: at most GEMV_MAX_ROWS tokens, fp32 caches and
        the rotary kernel in the step's tables."""
        meta = ctx.attn
        return (not meta.prefills and meta.num_decodes == num_tokens <= GEMV_MAX_ROWS
                and rope.kernel is not None and ctx.kv_caches[0][0].dtype == torch.float32)

    def run(self, hidden: torch.Tensor, rope: RopeTables, ctx: ForwardContext
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden_size] embeddings -> (last layer's output, residual),
        as the layer loop of LlamaModel.forward leaves them."""
        n, heads, kv_heads, dim = hidden.shape[0], self.heads, self.kv_heads, self.head_dim
        fused, gemv, eps = self.fused, self.gemv.gemv_linear, self.eps
        meta: AttentionMetadata = ctx.attn
        cos, sin = rope.cos.view(n, dim), rope.sin.view(n, dim)
        window = -1 if meta.sliding_window is None else meta.sliding_window
        qk_width = (heads + kv_heads) * dim
        residual = hidden.new_empty(0)   # the first norm has no residual to add
        for w, (k_cache, v_cache) in zip(self.layers, ctx.kv_caches):
            x, residual = fused.add_rms_norm(hidden, residual, w.input_norm, eps)
            qkv = gemv(x, w.qkv)
            if w.qkv_bias is not None:
                qkv.add_(w.qkv_bias)
            qk = fused.rotate_half(qkv[:, :qk_width].view(n, heads + kv_heads, dim), cos, sin)
            write_kv(qk[:, heads:], qkv[:, qk_width:].view(n, kv_heads, dim), k_cache, v_cache,
                     meta.slot_mapping)
            out = hidden.new_empty((n, heads, dim))
            self.attention.paged_decode_attention(
                out, qk[:, :heads].contiguous(), k_cache, v_cache, meta.decode_block_table,
                meta.decode_seq_lens, self.scale, window)
            x, residual = fused.add_rms_norm(gemv(out.view(n, -1), w.o), residual,
                                             w.post_norm, eps)
            hidden = gemv(fused.silu_and_mul(gemv(x, w.gate_up)), w.down)
        return hidden, residual
