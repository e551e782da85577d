"""Model registry: Hugging Face architecture name -> our model class (imported lazily)."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
}

# GGUF `general.architecture` -> Hugging Face architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"model: architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(supported_architectures())})")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
