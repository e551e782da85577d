"""Speculative decoding (n-gram drafts) on the real default model: outputs are those of the
engine without drafts (greedy, seeded sampling, penalties, stops, logprobs), whatever the
batch, chunking, prefix cache or preemption, and the KV pool ends empty."""

from __future__ import annotations

import pytest

from tests.helpers.oracle import assert_kv_clean, hf_greedy
from tokenmill import SamplingParams
from tokenmill.outputs import FinishReason
from tokenmill.spec.drafter import FIXED_COST_ROWS

# Every proposed draft checked: the tests below are about the mechanism; the adaptive policy
# (which drafts pay) has its own test.
SPEC = {"num_speculative_tokens": 3, "draft_policy": "all"}
# Repetitive prompts: the small model continues them, so many drafts are right and some not.
PROMPTS = [f"List {topic}: " + ", ".join([topic] * (3 + i)) for i, topic in enumerate(
    ["cats", "one two three", "red green blue", "the sea", "north south", "apples", "A B C D",
     "rain"])]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def token_ids(outputs):
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def spec_llm(make_llm):
    return make_llm(**SPEC)


@pytest.fixture(scope="module")
def without_drafts(llm):
    return token_ids(llm.generate(PROMPTS, GREEDY))


def drafts_checked(llm) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.spec_draft_tokens, stats.spec_accepted_tokens


def test_the_step_cost_is_measured_at_start_and_leaves_no_trace(make_llm):
    # first in the module: this engine has served nothing yet
    llm = make_llm(num_speculative_tokens=3)     # draft_policy: adaptive, the default
    stats = llm.engine.stats()
    # measured, not the default; on a CPU 16 rows take well over one row's time: F is a few
    # rows, not "free"
    assert stats.spec_step_fixed_rows != FIXED_COST_ROWS
    assert 0 < stats.spec_step_fixed_rows < 100, stats.spec_step_fixed_rows
    assert (stats.prefix_cache_queries, stats.num_preemptions, stats.spec_draft_tokens) == (0, 0, 0)
    kv = llm.engine.core.kv
    assert kv.tree.num_cached_blocks == 0 and kv.pool.num_free == kv.num_blocks
    assert not llm.engine.core.worker.runner.requests


def test_greedy_output_is_unchanged_and_drafts_pay(spec_llm, without_drafts):
    drafted, accepted = drafts_checked(spec_llm)
    assert token_ids(spec_llm.generate(PROMPTS, GREEDY)) == without_drafts
    drafted, accepted = (a - b for a, b in zip(drafts_checked(spec_llm), (drafted, accepted)))
    assert 0 < accepted < drafted, (accepted, drafted)   # kept and rejected drafts both seen
    one = [spec_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS[:3]]
    assert one == without_drafts[:3]
    assert_kv_clean(spec_llm)


def test_the_adaptive_policy_keeps_the_output_and_drafts_for_one_stream(make_llm,
                                                                        without_drafts):
    llm = make_llm(num_speculative_tokens=3)     # draft_policy: adaptive, the default
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == without_drafts
    accepted = drafts_checked(llm)[1]
    one = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS[:3]]
    assert one == without_drafts[:3]
    assert drafts_checked(llm)[1] > accepted     # one stream: right drafts pay
    assert_kv_clean(llm)


def test_greedy_matches_transformers_with_drafts(spec_llm, hf_oracle):
    tokenizer = spec_llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    kept_before = drafts_checked(spec_llm)[1]
    got = spec_llm.generate([ids], params)[0].outputs[0]
    assert drafts_checked(spec_llm)[1] > kept_before
    expected_tokens, expected_logprobs = hf_greedy(hf_oracle, ids, 48)
    assert got.token_ids == expected_tokens
    got_logprobs = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
    assert max(abs(a - b) for a, b in zip(got_logprobs, expected_logprobs)) < 2e-3
    assert_kv_clean(spec_llm)


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=24, max_prefill_chunk=7, unchunked_prefill_min=0),
    dict(num_kv_blocks=24, max_model_len=256),
    dict(prefix_cache=False, prompt_lookup_min=1, num_speculative_tokens=5),
    dict(draft_policy="adaptive", draft_fixed_cost=40.0),
], ids=["chunked", "preempted", "no-prefix-cache-k5", "adaptive-fixed-cost"])
def test_greedy_output_is_unchanged_under_other_switches(make_llm, without_drafts, options):
    llm = make_llm(**{**SPEC, **options})
    before = llm.engine.stats().num_preemptions
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == without_drafts
    if "draft_fixed_cost" in options:   # given, not measured
        assert llm.engine.stats().spec_step_fixed_rows == options["draft_fixed_cost"]
    if "num_kv_blocks" in options:
        assert llm.engine.stats().num_preemptions > before, "no preemption was forced"
    assert drafts_checked(llm)[1] > 0
    assert_kv_clean(llm)


def test_seeded_sampling_penalties_and_logprobs_are_unchanged(spec_llm, llm):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=7, logprobs=2),
              SamplingParams(temperature=0.5, max_tokens=32, seed=8, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.1),
              SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logit_bias={11: 2.0},
                             logprobs=1),
              SamplingParams(temperature=1.0, top_k=5, max_tokens=32, seed=9, n=2)]
    prompts = PROMPTS[:4]
    want = llm.generate(prompts, params)
    kept_before = drafts_checked(spec_llm)[1]
    got = spec_llm.generate(prompts, params)
    assert drafts_checked(spec_llm)[1] > kept_before
    for a, b in zip(want, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.logprobs is None:
                continue
            for ea, eb in zip(ca.logprobs, cb.logprobs):
                assert list(ea) == list(eb)       # the same top tokens, in the same order
                assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-3 for t in ea)
    assert_kv_clean(spec_llm)


def test_stops_inside_a_run_of_kept_drafts(spec_llm, llm, without_drafts):
    ref = without_drafts[1]
    # a token first seen well into the output, where drafts are being kept
    first = next(i for i, t in enumerate(ref) if i >= 8 and ref.index(t) == i)
    token = ref[first]
    kept_before = drafts_checked(spec_llm)[1]
    out = spec_llm.generate(PROMPTS[1], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[token]))[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == FinishReason.STOP
    assert drafts_checked(spec_llm)[1] > kept_before   # drafts were kept on the way there
    for limit in (1, 2, 7):
        short = spec_llm.generate(PROMPTS[1], SamplingParams(
            temperature=0, max_tokens=limit, ignore_eos=True))[0].outputs[0]
        assert short.token_ids == ref[:limit] and short.finish_reason == FinishReason.LENGTH
    text = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 4]
    cut = spec_llm.generate(PROMPTS[1], SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == FinishReason.STOP
    assert_kv_clean(spec_llm)
