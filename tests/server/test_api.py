"""The OpenAI endpoints through the official client, against a real server."""

from __future__ import annotations

import math

from tests.server.conftest import MODEL

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."}]


def test_models_version_tokenize(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat_tokens = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat_tokens["count"] > tokens["count"]


def test_greedy_chat_matches_offline_llm(client, make_llm):
    from tokenmill import SamplingParams
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                           temperature=0)
    offline = make_llm().chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert reply.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.id.startswith("chatcmpl-") and reply.created > 0 and reply.model == MODEL


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_completion_stream_and_usage(client, http):
    prompt = "The three primary colours are"
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == num_prompt and full.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.prompt_tokens == num_prompt
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                       temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + full.choices[0].text


def test_prompt_shapes_and_n(client, http):
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    as_text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                        temperature=0)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    many = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4, n=3,
                                     temperature=0.8, seed=3)
    assert sorted(c.index for c in many.choices) == list(range(6))
    assert many.usage.prompt_tokens == len(ids) + 2
    texts = client.completions.create(model=MODEL, prompt=["a b c", "1 2 3"], max_tokens=4,
                                      temperature=0)
    assert len(texts.choices) == 2


def test_chat_n_streaming(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=5, stream=True))
    by_index: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert set(by_index) == finished == {0, 1}


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16,
                                     temperature=0).choices[0].text
    stop = base.strip()[2:5]
    assert stop, base
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base[:base.index(stop)]


def test_seed_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                              temperature=1.0, seed=seed
                                              ).choices[0].message.content
    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy
        assert entry.logprob <= 0
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 and math.isfinite(v) for top, v in
               zip(lp.top_logprobs, lp.token_logprobs))


def test_cached_tokens_on_repeated_prefix(client):
    prefix = "Here is a long shared document about tokenmill caching. " * 12
    first = client.completions.create(model=MODEL, prompt=prefix + "Question one?",
                                      max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prefix + "Question two?",
                                       max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # token-exact: the document and "Question" (the first request's partly filled last block
    # is taken over), not the words after it
    assert first.usage.prompt_tokens - 3 <= cached < second.usage.prompt_tokens


def test_extra_parameters_accepted(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"42": 5}, user="me", seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5,
                    "stop_token_ids": [2], "priority": 1, "cache_salt": "tenant-a"})
    assert out.usage.completion_tokens == 5
