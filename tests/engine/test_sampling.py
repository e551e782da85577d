"""Sampling parameters end to end on the real default model."""

from __future__ import annotations

from tests.helpers.oracle import assert_kv_clean
from tokenmill import SamplingParams
from tokenmill.outputs import FinishReason

PROMPT = "Write a short story about a robot who learns to paint."


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, "ignore_eos": True, **kw})


_REFERENCE: dict[int, object] = {}


def reference(llm):
    """The greedy completion of PROMPT, computed once per engine (several tests compare to it)."""
    if id(llm) not in _REFERENCE:
        _REFERENCE[id(llm)] = llm.generate(PROMPT, greedy())[0].outputs[0]
    return _REFERENCE[id(llm)]


def test_stop_string_truncates_exactly(llm):
    ref = reference(llm)
    stop = ref.text[20:26]
    cut = ref.text.index(stop)
    out = llm.generate(PROMPT, greedy(stop=[stop]))[0].outputs[0]
    assert out.text == ref.text[:cut]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop
    kept = llm.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == ref.text[:cut + len(stop)]
    assert_kv_clean(llm)


def test_stop_token_ids_and_length(llm):
    ref = reference(llm)
    token = ref.token_ids[5]
    first = ref.token_ids.index(token)
    out = llm.generate(PROMPT, greedy(stop_token_ids=[token]))[0].outputs[0]
    assert out.token_ids == ref.token_ids[:first + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == token
    short = llm.generate(PROMPT, greedy(max_tokens=7))[0].outputs[0]
    assert short.token_ids == ref.token_ids[:7] and short.finish_reason == FinishReason.LENGTH
    assert_kv_clean(llm)


def test_eos_and_min_tokens(llm):
    chat = [{"role": "user", "content": "Say only the word yes."}]
    natural = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert natural.finish_reason == FinishReason.STOP and len(natural.token_ids) < 20
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64,
                                           min_tokens=len(natural.token_ids) + 10))[0].outputs[0]
    assert len(longer.token_ids) >= len(natural.token_ids) + 10
    eos = set(llm.engine.core.worker.eos_token_ids)
    assert not eos & set(longer.token_ids[:len(natural.token_ids) + 9])
    ignored = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40,
                                            ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == FinishReason.LENGTH
    assert_kv_clean(llm)


def test_logit_bias_forces_a_token(llm):
    token = llm.get_tokenizer().encode(" banana")[0]
    out = llm.generate(PROMPT, greedy(max_tokens=5, logit_bias={token: 100}))[0].outputs[0]
    assert out.token_ids == [token] * 5


def test_penalties_reduce_repetition(llm):
    prompt = "Repeat after me: apple apple apple apple apple apple"
    plain = llm.generate(prompt, greedy(max_tokens=32))[0].outputs[0].token_ids
    penalized = llm.generate(prompt, greedy(max_tokens=32, frequency_penalty=2.0,
                                            presence_penalty=2.0))[0].outputs[0].token_ids
    repeated = llm.generate(prompt, greedy(max_tokens=32, repetition_penalty=2.0))[0]
    assert len(set(penalized)) > len(set(plain))
    assert len(set(repeated.outputs[0].token_ids)) > len(set(plain))


def test_truncations_that_leave_one_token_equal_greedy(llm):
    ref = reference(llm).token_ids
    for params in (dict(temperature=0.7, top_k=1, seed=1), dict(temperature=0.7, top_p=1e-6, seed=2),
                   dict(temperature=0.7, min_p=1.0, seed=3)):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, **params))[0]
        assert out.outputs[0].token_ids == ref[:24], params


def test_logprobs_top_n(llm):
    out = llm.generate(PROMPT, greedy(max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1 and len(entry) == 3  # greedy: the chosen is the best
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert values[0] <= 0 and entry[token].logprob == values[0]
        assert all(lp.decoded_token is not None for lp in entry.values())
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.5, seed=7,
                                                  logprobs=2, ignore_eos=True))[0].outputs[0]
    assert len(sampled.token_ids) == 30
    ranks = [entry[t].rank for t, entry in zip(sampled.token_ids, sampled.logprobs)]
    assert any(rank > 1 for rank in ranks), "hot sampling should pick a non-top token sometime"
    assert abs(sampled.cumulative_logprob - sum(e[t].logprob for t, e in
                                                zip(sampled.token_ids, sampled.logprobs))) < 1e-6


def test_n_siblings_share_prompt_blocks(make_llm):
    llm = make_llm(prefix_cache=False)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode("Tell me a story. " * 20)  # 100 tokens: 6 full blocks
    engine.add_request("fan", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8))
    while len(engine.core.scheduler.running) < 4:
        engine.step()
    tables = [engine.core.kv.block_ids(f"fan:{i}") for i in range(4)]
    full = len(prompt) // 16
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({b for t in tables for b in t}) < 4 * len(tables[0])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    texts = [c.text for c in outputs[0].outputs]
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert_kv_clean(llm)


def test_stream_grows_to_the_final_text(llm):
    pieces = [out.outputs[0].text for out in llm.stream(PROMPT, greedy(max_tokens=20))]
    assert all(b.startswith(a) for a, b in zip(pieces, pieces[1:]))
    assert pieces[-1] == llm.generate(PROMPT, greedy(max_tokens=20))[0].outputs[0].text
    assert_kv_clean(llm)


def test_metrics_and_order(llm):
    prompts = [PROMPT, "Hi", "List three fruits."]
    outs = llm.generate(prompts, greedy(max_tokens=4))
    assert [o.prompt for o in outs] == prompts
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
