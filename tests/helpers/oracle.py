"""Reference generation with Hugging Face transformers, and comparison helpers."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities, ignoring EOS, with HF's own KV cache."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(num_tokens):
        step_logprobs = out.logits[0, -1].float().log_softmax(-1)
        token = int(step_logprobs.argmax())
        tokens.append(token)
        logprobs.append(float(step_logprobs[token]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def assert_kv_clean(llm) -> None:
    """No request holds a block, the books balance, and the pool is whole once evicted."""
    engine = llm.engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_usage == 0.0, f"blocks still held: usage {engine.kv_usage}"
    kv = engine.core.kv
    kv.evict_all()
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_blocks
