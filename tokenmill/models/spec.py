"""ModelSpec: the architecture hyperparameters, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    architecture: str                 # Hugging Face class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False       # bias on q, k, v (Qwen2)
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V per token across layers (times the cache dtype's size: bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope(config: dict) -> tuple[float, dict | None]:
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta), scaling


def spec_from_hf_config(model_dir: Path) -> ModelSpec:
    config = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    eos = _as_tuple(config.get("eos_token_id"))
    if generation.exists():
        eos = tuple(dict.fromkeys(eos + _as_tuple(json.loads(generation.read_text())
                                                  .get("eos_token_id"))))
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        raise ValueError(f"model: only SiLU-gated MLPs without bias are supported "
                         f"(hidden_act={config.get('hidden_act')!r}, "
                         f"mlp_bias={config.get('mlp_bias')})")
    architectures = config.get("architectures") or [config.get("model_type", "?")]
    heads = config["num_attention_heads"]
    theta, scaling = _rope(config)
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:
        window = None
    arch = architectures[0]
    return ModelSpec(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", arch == "Qwen2ForCausalLM"),
        sliding_window=window,
        rope_scaling=scaling,
        eos_token_ids=eos,
        bos_token_id=config.get("bos_token_id"),
    )
