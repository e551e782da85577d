"""The radix prefix cache: same greedy output on and off, real reuse, private namespaces."""

from __future__ import annotations

import random

import pytest

from tests.helpers.oracle import assert_kv_clean
from tokenmill import SamplingParams

SYSTEM = ("You are a meticulous assistant for a public library. Answer questions about opening "
          "hours, lending rules, membership, events and the catalogue. Be brief and friendly, "
          "never invent facts, and say when you do not know. ") * 6
QUESTIONS = ["Can I renew a book online?", "When does the library open on Sunday?",
             "How many books can I borrow?", "Is there a children's reading hour?",
             "Do you lend e-readers?", "What happens if I lose a book?",
             "Can I print documents there?", "Are pets allowed inside?"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def chats(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def cache_off(make_llm):
    return make_llm(prefix_cache=False)


def test_shared_prefix_batch_same_output_and_reused(make_llm, cache_off):
    llm = make_llm(policy="lpm")
    expected = ids(cache_off.chat([chats(q) for q in QUESTIONS], GREEDY))
    before = llm.engine.stats()
    outputs = llm.chat([chats(q) for q in QUESTIONS], GREEDY)
    assert ids(outputs) == expected
    after = llm.engine.stats()
    prompt_len = len(outputs[0].prompt_token_ids)
    # Only the first request computes the shared system prompt; the rest wait for it.
    assert sum(o.num_cached_tokens > prompt_len // 2 for o in outputs) == len(QUESTIONS) - 1
    assert after.prefix_cache_hits - before.prefix_cache_hits > 6 * prompt_len
    assert after.prefix_cache_blocks > 0
    assert_kv_clean(llm)


def test_multi_turn_chat_reuses_every_earlier_turn(llm, cache_off):
    conversations = [[{"role": "system", "content": SYSTEM}] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=32)
    turns = [["Hello!", "Do you open on holidays?", "And on Sundays?", "Thanks, bye."],
             ["Hi there", "I lost a book.", "What does it cost?", "Can I pay by card?"],
             ["Good morning", "Any events today?", "For kids?", "What time?"]]
    for turn in range(4):
        for conversation, said in zip(conversations, turns):
            conversation.append({"role": "user", "content": said[turn]})
        on = llm.chat(conversations, params)
        off = cache_off.chat(conversations, params)
        assert ids(on) == ids(off)
        if turn:
            for out in on:
                rate = out.num_cached_tokens / len(out.prompt_token_ids)
                assert rate >= 0.9, f"turn {turn + 1}: hit rate {rate:.2f}"
        for conversation, out in zip(conversations, on):
            conversation.append({"role": "assistant", "content": out.outputs[0].text})
    assert_kv_clean(llm)


def test_a_continued_conversation_computes_only_its_new_tokens(llm, cache_off):
    """Token-exact hits: the previous turn's partly filled last block is taken over, so a turn
    computes its new tokens and the one token the last turn sampled but never fed back."""
    tokenizer = llm.get_tokenizer()
    tokens = tokenizer.encode(SYSTEM + "Question: can I renew a book online?")
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    computed_before = None
    for turn, question in enumerate([" Thanks. And by phone?", " What about e-books?", ""]):
        on = llm.generate({"prompt_token_ids": tokens}, params)[0]
        off = cache_off.generate({"prompt_token_ids": tokens}, params)[0]
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        if computed_before is not None:
            assert on.num_cached_tokens == computed_before, f"turn {turn + 1}"
        output = list(on.outputs[0].token_ids)
        computed_before = len(tokens) + len(output) - 1
        assert computed_before % 16, "a whole last block would not test a tail"
        tokens = tokens + output + tokenizer.encode(question)
    assert_kv_clean(llm)


def test_eviction_under_pressure_keeps_output(make_llm, cache_off):
    llm = make_llm(num_kv_blocks=48, max_model_len=512)
    prompts = [chats(q) for q in QUESTIONS]
    expected = ids(cache_off.chat(prompts, GREEDY))
    evicted_before = llm.engine.stats().prefix_cache_evicted_blocks
    for _ in range(2):  # the second round runs on whatever the first left cached
        assert ids(llm.chat(prompts, GREEDY)) == expected
        llm.engine.check_integrity()
    assert llm.engine.stats().prefix_cache_evicted_blocks > evicted_before
    assert_kv_clean(llm)


def test_cache_salt_keeps_prefixes_apart(llm):
    prompt = llm.get_tokenizer().encode(SYSTEM + "Question: where is the exit?")
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY)
    bob = llm.generate({"prompt_token_ids": prompt, "cache_salt": "bob"}, GREEDY)[0]
    alice = llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY)[0]
    unsalted = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert bob.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert alice.num_cached_tokens >= len(prompt) - 16
    assert bob.outputs[0].token_ids == alice.outputs[0].token_ids
    assert_kv_clean(llm)


def test_preempted_request_resumes_from_cache(make_llm):
    llm = make_llm(num_kv_blocks=40, max_model_len=512)
    rng = random.Random(0)
    # Unrelated prompts: every cache hit here is a preempted request finding its own blocks.
    prompts = [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(6)]
    before = llm.engine.stats()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.num_preemptions > before.num_preemptions
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    assert all(len(o.outputs[0].token_ids) == 64 for o in outputs)
    assert_kv_clean(llm)
