"""Shared fixtures: the real default model, the Hugging Face oracle, tiny random models."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def default_model():
    """The default model's ModelSource, pulled on first use."""
    from tokenmill.models_hub import resolve
    return resolve(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_oracle(default_model):
    """Hugging Face transformers running the same GGUF weights (its own dequantization)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        str(default_model.path.parent), gguf_file=default_model.path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def make_llm():
    """Build (and cache for the session) an LLM on the default model with given options."""
    from tokenmill import LLM
    cache: dict[tuple, object] = {}

    def make(**options):
        options = {"model": DEFAULT_MODEL, "kv_cache_memory": 0.25, "max_model_len": 2048,
                   **options}
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = LLM(**options)
        return cache[key]

    yield make
    cache.clear()


@pytest.fixture(scope="session")
def llm(make_llm):
    return make_llm()
