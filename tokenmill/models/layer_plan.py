"""LayerPlan: the decoder layers of a Llama-family model for a step, as one flat loop over the
CPU kernels, run in C++ (layer_plan_kernel.cpp).

At batch 1 the module path spent about 3 ms of a 27 ms token in Python: ten nn.Module calls
per layer, the attention backend's general bookkeeping (prefill spans, a copy into a shared
output) and their small tensor ops. A flat Python loop over the kernels still made some 600
dispatches a token. The plan keeps each layer's kernel-ready weights and calls the same
kernels, in the same order, on the same tensors, so its output is bitwise that of the module
path (test_layer_plan_is_bitwise_the_module_path in tests/model/test_fast_paths.py). It also
looks up the step's rotary rows and applies the model's final norm, so the forward pass is one
call (from Python those took ~40 and ~24 us of a one-request step).
Each linear runs as the module would for the step's size: the small-M kernel's panels, or
GGUF Q4_1 (Q8_0) weights on the AMX tiles from their min_rows (layers/cpu_amx.py).

Steps with prefill chunks run in the loop too (the chunks' attention in one call of the
paged prefill kernel, after the decodes'): py-spy put ~15% of a 300-token prefill step
through the modules outside the kernels (module calls, views, q/k/v splits, fresh outputs).
In one process, the two ways alternating per request, prefills of 16 / 64 / 300 / 1024 /
2000 tokens took 20.7 / 47.4 / 179.5 / 719 / 1896 ms through the modules and 13.7 / 36.8 /
153.4 / 686 / 1728 in the loop; 300 tokens beside 15 decodes 191.8 -> 165.5 ms. Steps
whose linears the module would run on oneDNN or on hi + lo tiles (no kernel here), chunks
with a sliding window or that SDPA takes (cpu_paged.py), and every step when a kernel cannot
be built, go through the modules.
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
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

LOOP = CpuExtension("tokenmill_layer_plan", Path(__file__).with_name("layer_plan_kernel.cpp"),
                    ["run_layers"], "C++ layer loop", "the layer modules",
                    headers=(ENTRY_POINTS,), keep_gil=("run_layers",))  # it lets go itself


_NONE = torch.empty(0)
_NO_CHUNKS = torch.empty(0, 4, dtype=torch.long)
_NO_TABLES = torch.empty(0, dtype=torch.long)


def _on_tiles(linear: Linear, num_tokens: int) -> bool:
    """Whether the module takes a step this long on factored (Q4_1 or Q8_0) tiles
    (Linear.forward)."""
    tiles = linear.amx_weight
    return tiles is not None and tiles.steps is not None and num_tokens >= tiles.min_rows


def _in_loop(linear: Linear, num_tokens: int) -> bool:
    """Whether the loop has the kernel the module runs for a step this long
    (Linear.forward): the small-M kernel's panels or factored tiles."""
    tiles = linear.amx_weight
    return (_on_tiles(linear, num_tokens)
            or (linear.has_gemv_panels and num_tokens <= GEMV_MAX_ROWS
                and (tiles is None or num_tokens < tiles.min_rows)))


def _linear_weights(linear: Linear, num_tokens: int) -> list[torch.Tensor]:
    """The three tensors run_layers takes for a linear: its tiles' levels, steps and
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
        """The 15 tensors run_layers takes for this layer (no bias: an empty tensor)."""
        bias = self.qkv_bias if self.qkv_bias is not None else _NONE
        return [self.input_norm, self.post_norm, bias,
                *(t for m in self.linears for t in _linear_weights(m, num_tokens))]


class LayerPlan:
    def __init__(self, layers: list[_Layer], rotary: RotaryEmbedding, final_norm: torch.Tensor,
                 eps: float, heads: int, kv_heads: int, scale: float, backend: CpuPagedBackend,
                 loop: ModuleType, kernel_entry_points: list[object]) -> None:
        self.layers = layers
        self.rotary, self.final_norm = rotary, final_norm
        self.num_layers = len(layers)
        # From this size on every linear takes a step as it takes any longer one (the panels'
        # limit and the tiles' min_rows lie below), so longer steps share its entries.
        min_rows = [m.amx_weight.min_rows for layer in layers for m in layer.linears
                    if m.amx_weight is not None]
        self._uniform_from = max([GEMV_MAX_ROWS, *min_rows]) + 1
        # by step size (up to _uniform_from): whether the loop takes it, and run_layers'
        # one flat list of weights, 15 per layer (compact panels for the fewest tokens, tiles
        # for the most), made once
        self._takes_size: dict[int, bool] = {}
        self._weights_by_size: dict[int, list[torch.Tensor]] = {}
        self._prefill_kernel_takes: dict[tuple[int, ...], bool] = {}   # by cache shape
        self.eps, self.heads, self.kv_heads, self.scale = eps, heads, kv_heads, scale
        self.backend, self.loop, self.entry_points = backend, loop, kernel_entry_points

    @classmethod
    def build(cls, layers: nn.ModuleList, rotary: RotaryEmbedding, norm: RMSNorm
              ) -> LayerPlan | None:
        """The plan for `layers` (LlamaDecoderLayer) with the model's rotary tables and final
        `norm`, or None unless every part of them runs on the CPU kernels: cpu_fused norms and
        rotary, cpu_gemv linears ("hybrid"), the cpu_paged attention kernel, and the C++ loop
        over them builds."""
        if norm.kernel is None or norm.eps != layers[0].input_layernorm.eps:
            return None
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
        if any(m.amx_weight is not None for layer in plan_layers for m in layer.linears):
            kernels.append(cpu_amx.load_kernel())   # it packed them, so it loads
        return cls(plan_layers, rotary, norm.weight, first.input_layernorm.eps, attn.num_heads,
                   attn.num_kv_heads, attn.backend.scale, attn.backend, loop,
                   [e for k in kernels for e in k.entry_points()])

    def takes(self, num_tokens: int) -> bool:
        """Whether every linear of a step this long runs on a kernel the loop has."""
        size = min(num_tokens, self._uniform_from)
        takes = self._takes_size.get(size)
        if takes is None:
            takes = all(_in_loop(m, size) for layer in self.layers for m in layer.linears)
            self._takes_size[size] = takes
        return takes

    def weights(self, num_tokens: int) -> list[torch.Tensor]:
        if not self.takes(num_tokens):
            raise ValueError(f"layer plan: no kernel here for some linear of a "
                             f"{num_tokens}-token step")
        size = min(num_tokens, self._uniform_from)
        weights = self._weights_by_size.get(size)
        if weights is None:
            weights = [t for layer in self.layers for t in layer.weights(size)]
            self._weights_by_size[size] = weights
        return weights

    def accepts(self, num_tokens: int, ctx: ForwardContext) -> bool:
        """A step the kernels take: linears for its size, fp32 caches, the rotary kernel, and
        prefill chunks (if any) for the paged prefill kernel."""
        meta = ctx.attn
        if (self.rotary.kernel is None or self.rotary.cos.dtype != torch.float32
                or ctx.kv_caches[0][0].dtype != torch.float32
                or not self.takes(num_tokens)):
            return False
        return not meta.prefills or (
            meta.sliding_window is None and self._prefill_kernel_fits(ctx.kv_caches[0])
            and not any(self.backend.sdpa_takes(span) for span in meta.prefills))

    def _prefill_kernel_fits(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether the prefill kernel takes chunks over caches of this shape (it tells by its
        answer for none)."""
        shape = tuple(kv_cache[0].shape)
        fits = self._prefill_kernel_takes.get(shape)
        if fits is None:
            query = torch.empty(0, self.heads, shape[-1])
            fits = bool(self.backend.kernel.paged_prefill_attention(
                query, query, *kv_cache, _NO_CHUNKS, _NO_TABLES, self.scale))
            self._prefill_kernel_takes[shape] = fits
        return fits

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
            ) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] embeddings, positions: [num_tokens] -> the final
        norm of the last layer's output, as LlamaModel.forward's modules leave it."""
        n = hidden.shape[0]
        meta: AttentionMetadata = ctx.attn
        window = -1 if meta.sliding_window is None else meta.sliding_window
        caches = [c for kv in ctx.kv_caches[:self.num_layers] for c in kv]
        chunks, tables = meta.packed_prefills if meta.prefills else (_NO_CHUNKS, _NO_TABLES)
        normed, _ = self.loop.run_layers(
            hidden, self.weights(n), self.final_norm, caches, positions, self.rotary.cos,
            self.rotary.sin, meta.slot_mapping, meta.num_decodes, meta.decode_block_table,
            meta.decode_seq_lens, chunks, tables, self.eps, self.heads, self.kv_heads,
            self.scale, window, self.entry_points)
        return normed
