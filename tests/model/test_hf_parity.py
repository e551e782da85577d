"""Greedy tokens equal Hugging Face transformers on the same weights; logprobs close."""

from __future__ import annotations

import pytest

from tests.helpers.oracle import assert_kv_clean, hf_greedy
from tokenmill import SamplingParams

NUM_TOKENS = 64
LOGPROB_TOL = 2e-3

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Les montagnes les plus hautes du monde sont",
    "1, 2, 3, 5, 8, 13,",
    # over 80 tokens: a step of its own that long runs the linears on the AMX tiles where the
    # CPU has them (layers/cpu_amx.py)
    "The mill stood by the river for three hundred years. Every spring the water rose and "
    "turned the great wheel faster, and the miller's family worked from dawn until the lamps "
    "were lit, grinding wheat and rye for the villages along the valley. Travellers who "
    "crossed the old stone bridge would stop to watch the wheel, and children dared each "
    "other to touch the cold spray. When the railway came, the miller's grandson",
]
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue, and then list three colours of a rainbow.",
]


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in RAW_PROMPTS]
    for question in CHAT_PROMPTS:
        text = tokenizer.render_chat([{"role": "user", "content": question}])
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def test_greedy_matches_transformers(llm, hf_oracle, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompt_ids, params)
    for ids, out in zip(prompt_ids, outputs):
        expected_tokens, expected_logprobs = hf_greedy(hf_oracle, ids, NUM_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == expected_tokens, llm.get_tokenizer().decode(ids)
        got_logprobs = [entry[token].logprob for entry, token in zip(got.logprobs, got.token_ids)]
        worst = max(abs(a - b) for a, b in zip(got_logprobs, expected_logprobs))
        assert worst < LOGPROB_TOL, f"logprob differs by {worst}"
    assert_kv_clean(llm)


def test_prompt_logprobs_match_transformers(llm, hf_oracle, prompt_ids):
    import torch
    ids = max(prompt_ids, key=len)   # prefilled alone, in one step of its whole length
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.inference_mode():
        reference = hf_oracle(torch.tensor([ids])).logits[0].log_softmax(-1)
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        token = ids[position]
        assert abs(entry[token].logprob - float(reference[position - 1, token])) < LOGPROB_TOL
        top = int(reference[position - 1].argmax())
        assert top in entry and entry[top].rank == 1
    assert_kv_clean(llm)
