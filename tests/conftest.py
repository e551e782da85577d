"""Shared fixtures: the real default model, the Hugging Face oracle, tiny random models."""

from __future__ import annotations

import gc
import os
from collections import OrderedDict

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_MODEL = "smollm2-135m-instruct"


def pytest_configure(config):
    """The C++ kernels built side by side before collection (test modules ask for them as
    they are imported, one at a time): on a fresh checkout that is ~1 minute, not ~3."""
    from tokenmill.kernels.cpp_build import load_in_parallel
    from tokenmill.models.loader import CPU_KERNELS
    load_in_parallel(CPU_KERNELS)


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


# Each LLM holds about 1.5 GB (the weights in three layouts, the KV cache): the suite's dozen
# configurations, all kept, came to 20 GB of this machine's 24 and were killed for memory.
_MAX_CACHED_LLMS = 3


@pytest.fixture(scope="session")
def make_llm():
    """Build an LLM on the default model with given options; the last few stay cached."""
    from tokenmill import LLM
    cache: OrderedDict[tuple, object] = OrderedDict()

    def make(**options):
        options = {"model": DEFAULT_MODEL, "kv_cache_memory": 0.25, "max_model_len": 2048,
                   **options}
        key = tuple(sorted(options.items()))
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        while len(cache) >= _MAX_CACHED_LLMS:
            cache.popitem(last=False)
            gc.collect()                  # free its memory before the next one is built
        cache[key] = LLM(**options)
        return cache[key]

    yield make
    cache.clear()


@pytest.fixture(scope="session")
def llm(make_llm):
    return make_llm()
