"""GGUF files: model spec from the metadata, weights dequantized into the compute dtype.

Names are mapped to Hugging Face checkpoint names so one `load_weights` serves both formats.
llama.cpp stores Llama q/k projections with rows permuted for its interleaved RoPE; they are
permuted back to the rotate-half layout our RotaryEmbedding (and HF) uses.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tokenmill.models.registry import GGUF_ARCHITECTURES, supported_architectures
from tokenmill.models.spec import ModelSpec

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_PERMUTED_ARCHS = ("llama", "mistral")


@functools.cache
def _plain_view_reader() -> type:
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of its memory map: it parses each of the
        ~100,000 vocabulary strings as small slices, and a slice of an np.memmap is another
        memmap object (`__array_finalize__` each time). SmolLM2's file: 4.3 -> 1.3 s a load."""

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)   # the map stays alive as its base

    return PlainViewReader


def open_gguf(path: Path):
    try:
        return _plain_view_reader()(str(path))
    except Exception as exc:  # the reader raises many kinds on a bad file
        raise ValueError(f"model: cannot read GGUF file {path}: {exc}") from exc


def field(reader, key: str, default: Any = None) -> Any:
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def spec_from_gguf(reader) -> ModelSpec:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(supported_architectures())})")
    names = {t.name for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    eos = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelSpec(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=get("vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv") or heads,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        sliding_window=get("attention.sliding_window"),
        rope_scaling=_rope_scaling(reader, arch, names),
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
    )


def _rope_scaling(reader, arch: str, names: set[str]) -> dict | None:
    if "rope_freqs.weight" in names:  # Llama 3.x: per-frequency divisors stored as a tensor
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        return {"rope_type": "freq_factors", "factors": np.asarray(tensor.data).tolist()}
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": kind, "factor": field(reader, f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings":
                field(reader, f"{arch}.rope.scaling.original_context_length")}


def hf_name(gguf_name: str) -> str | None:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, leaf = match.groups()
        mapped = _LAYER_NAMES.get(part)
        return mapped and f"model.layers.{layer}.{mapped}.{leaf}"
    base, _, leaf = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(base)
    return mapped and f"{mapped}.{leaf}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave: (head, half, pair) -> (head, pair, half)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(reader, spec: ModelSpec, dtype: torch.dtype
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    arch = field(reader, "general.architecture")
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue
            raise ValueError(f"model: unexpected tensor {tensor.name!r} in GGUF file")
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type))  # writable copy
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = spec.num_heads if "q_proj" in name else spec.num_kv_heads
            array = _unpermute(array, heads)
        yield name, torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
