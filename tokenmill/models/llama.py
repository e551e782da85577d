"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2): our own code on layers/.

Parameter names mirror Hugging Face checkpoints, except that q/k/v and gate/up are merged into
one GEMM each (`qkv_proj`, `gate_up_proj`); `load_weights` maps the checkpoint's parts in.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.attention.registry import backend_class
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.embedding import Embedding
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding
from tokenmill.models.layer_plan import LayerPlan
from tokenmill.models.spec import ModelSpec

# checkpoint sub-name -> (our merged module, part index)
_MERGED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, backend: TorchReferenceBackend
                 ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (spec.num_heads, spec.num_kv_heads,
                                                            spec.head_dim)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden_size, [q_size, kv_size, kv_size],
                                     bias=spec.attention_bias)
        self.o_proj = Linear(q_size, spec.hidden_size)
        self.backend = backend

    def forward(self, rope: RopeTables, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """rope: this step's cos/sin tables (RotaryEmbedding.tables);
        hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        # q and k rotate together: one set of elementwise ops instead of two
        qk = qkv[:, :(heads + kv_heads) * self.head_dim].view(num_tokens, heads + kv_heads,
                                                               self.head_dim)
        q, k = RotaryEmbedding.rotate(rope, qk).split([heads, kv_heads], dim=1)
        v = qkv[:, (heads + kv_heads) * self.head_dim:].view(num_tokens, kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, ctx.kv_caches[self.layer_index], ctx.attn)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(spec.hidden_size, [spec.intermediate_size] * 2)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, backend: TorchReferenceBackend
                 ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, layer_index, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = LlamaMLP(spec)

    def forward(self, rope, hidden, residual, ctx):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, attention_backend: str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        backend = backend_class(attention_backend)(spec.num_heads, spec.num_kv_heads,
                                                   spec.head_dim, spec.head_dim ** -0.5)
        self.rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta,
                                      spec.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, i, backend)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layer_plan: LayerPlan | None = None   # set by build_layer_plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        plan = self.layer_plan
        if plan is not None and plan.accepts(hidden.shape[0], ctx):
            return plan.run(hidden, positions, ctx)   # the final norm included
        rope = self.rotary.tables(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int,
                 attention_backend: str = "torch") -> None:
        """attention_backend: a registered name (tokenmill.attention.registry), not "auto"."""
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, max_positions, attention_backend)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def build_layer_plan(self) -> bool:
        """Run the steps it takes through a LayerPlan when every layer is on the CPU kernels
        (call after the linears are packed and the fused kernels enabled); returns whether."""
        self.model.layer_plan = LayerPlan.build(self.model.layers, self.model.rotary,
                                                self.model.norm)
        return self.model.layer_plan is not None

    def embed_from_lm_head(self) -> bool:
        """With tied embeddings and the lm_head on compact panels, look tokens up in those
        panels and drop the fp32 table (layers/embedding.py); returns whether."""
        panels = self.lm_head.gemv_compact
        if not self.spec.tie_word_embeddings or panels is None:
            return False
        self.model.embed_tokens.read_from_panels(panels)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 logits."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            target = self._load_one(name, tensor, params)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"model: checkpoint lacks weights for {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict) -> str:
        prefix, _, leaf = name.rpartition(".")        # leaf: weight | bias
        module_path, _, part = prefix.rpartition(".")
        if part in _MERGED:
            merged_name, index = _MERGED[part]
            module = self.get_submodule(f"{module_path}.{merged_name}")
            module.load_shard(index, tensor, is_bias=leaf == "bias")
            return f"{module_path}.{merged_name}.{leaf}"
        if name not in params:
            raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"model: weight {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        return name
