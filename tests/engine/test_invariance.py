"""Feature switches must not change greedy output: batch composition, chunked prefill,
preemption. Seeded sampling must not depend on what else is in the batch."""

from __future__ import annotations

import pytest

from tests.helpers.oracle import assert_kv_clean
from tokenmill import SamplingParams

TOPICS = ["a lighthouse keeper", "the history of tea", "how volcanoes form", "a chess game",
          "the first snowfall", "quantum computers", "a lost umbrella", "bread baking",
          "the Roman empire", "a talking parrot", "deep sea fish", "a marathon runner",
          "the northern lights", "a broken clock", "jazz music", "a desert caravan"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llm):
    tokenizer = llm.get_tokenizer()
    # Lengths from ~5 to ~190 tokens, so chunking and block boundaries differ per prompt.
    return [tokenizer.encode(f"Write about {topic}. " + "Give details. " * (i * 4))
            for i, topic in enumerate(TOPICS)]


@pytest.fixture(scope="module")
def one_at_a_time(llm, prompts):
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def token_ids(outputs):
    return [out.outputs[0].token_ids for out in outputs]


def test_batch_of_16_equals_one_at_a_time(llm, prompts, one_at_a_time):
    assert token_ids(llm.generate(prompts, GREEDY)) == one_at_a_time
    assert_kv_clean(llm)


def test_batch_of_32_equals_one_at_a_time(llm, prompts, one_at_a_time):
    """32 decoding at once: where the CPU has AMX tiles, the layer plan runs the linears on
    their bf16 levels (more than 16 rows; layers/cpu_amx.py), and the lm_head too."""
    assert token_ids(llm.generate(prompts + prompts, GREEDY)) == one_at_a_time * 2
    assert_kv_clean(llm)


@pytest.mark.parametrize("whole_from, budget, idle", [(0, 24, 0), (100, 24, 0), (0, 24, 96),
                                                      (0, 96, 24)],
                         ids=["all-chunked", "long-ones-whole", "idle-steps-larger",
                              "idle-steps-smaller"])
def test_tiny_prefill_chunks_equal_unchunked(make_llm, prompts, one_at_a_time, whole_from,
                                             budget, idle):
    """whole_from: prompts of at least this many tokens are prefilled in one step, past the
    budget, beside the chunks and decodes of the others. idle: the budget of steps in which
    nothing decodes yet (larger: prompts whole up to it; smaller: a short first step)."""
    llm = make_llm(max_num_batched_tokens=budget, unchunked_prefill_min=whole_from,
                   idle_batched_tokens=idle, max_prefill_chunk=None if idle else 7)
    assert token_ids(llm.generate(prompts, GREEDY)) == one_at_a_time
    assert_kv_clean(llm)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_keeps_output(make_llm, prompts, one_at_a_time, prefix_cache):
    llm = make_llm(num_kv_blocks=40, max_model_len=512, prefix_cache=prefix_cache)
    before = llm.engine.stats().num_preemptions
    assert token_ids(llm.generate(prompts, GREEDY)) == one_at_a_time
    assert llm.engine.stats().num_preemptions > before, "the tiny KV budget forced no preemption"
    assert_kv_clean(llm)


def test_seeded_sampling_ignores_batch_composition(make_llm, llm, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, max_tokens=24, seed=1234)
    alone = llm.generate([prompts[3]], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30)
    mixed = llm.generate(prompts[:8], [others] * 3 + [seeded] + [others] * 4)
    assert mixed[3].outputs[0].token_ids == alone
    squeezed = make_llm(num_kv_blocks=40, max_model_len=512)
    crowded = squeezed.generate(prompts, [others] * 3 + [seeded] + [others] * 12)
    assert crowded[3].outputs[0].token_ids == alone
    unseeded = llm.generate([prompts[3]] * 2, SamplingParams(temperature=1.0, max_tokens=24))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids
    assert_kv_clean(llm)
    assert_kv_clean(squeezed)
