"""Incremental detokenization with the real default tokenizer: UTF-8 safe, exact stops."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams

TEXTS = ["héllo wörld — naïve café", "你好，世界！这是一个测试。", "emoji 🎉🚀 and more 👩‍👩‍👧",
         "def f(x):\n    return x ** 2\n", "Ünïcödé ✓ ∑ ∫ ≈ ≠ ∞"]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return Tokenizer(default_model.tokenizer_dir)


def feed_one_by_one(tokenizer, ids, params, prompt=(1, 2)):
    detok = IncrementalDetokenizer(tokenizer, params, list(prompt))
    visible = []
    for token in ids:
        stop, _ = detok.update([token])
        visible.append(detok.visible_text(finished=stop is not None))
        if stop is not None:
            return detok, visible, stop
    return detok, visible, None


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok, visible, _ = feed_one_by_one(tokenizer, ids, SamplingParams())
    assert detok.text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in visible)
    assert all(b.startswith(a) for a, b in zip(visible, visible[1:]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(100, 49151), min_size=1, max_size=40))
@example([5549])   # " " + a lone byte: the whole piece waits, its space too
def test_random_token_streams_decode_like_the_whole(tokenizer, ids):
    detok, visible, _ = feed_one_by_one(tokenizer, ids, SamplingParams())
    full = tokenizer.decode(ids)
    # Pieces that end in a character not yet complete are held back, never shown broken.
    held_back = full[len(detok.text):]
    assert full.startswith(detok.text) and (held_back == "" or held_back.endswith("\ufffd"))
    assert all(b.startswith(a) for a, b in zip(visible, visible[1:]))


def test_stop_string_cut_and_holdback(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. The end."
    ids = tokenizer.encode(text)
    detok, visible, stop = feed_one_by_one(tokenizer, ids, SamplingParams(stop=["lazy dog", "zzz"]))
    assert stop == "lazy dog" and detok.text == "The quick brown fox jumps over the "
    assert all(not piece.endswith(("l", "la", "laz")) for piece in visible[:-1])
    assert all(detok.text.startswith(piece) for piece in visible)
    detok, _, stop = feed_one_by_one(
        tokenizer, ids, SamplingParams(stop=["lazy dog"], include_stop_str_in_output=True))
    assert detok.text == "The quick brown fox jumps over the lazy dog"


def test_stop_inside_a_token_cuts_mid_token(tokenizer):
    ids = tokenizer.encode("alphabet soup")
    detok, _, stop = feed_one_by_one(tokenizer, ids, SamplingParams(stop=["phab"]))
    assert stop == "phab" and detok.text == "al"


def test_earliest_of_several_stops_wins(tokenizer):
    rng = random.Random(0)
    words = ["red", "green", "blue", "cyan", "magenta"]
    text = " ".join(rng.choice(words) for _ in range(30))
    ids = tokenizer.encode(text)
    detok, _, stop = feed_one_by_one(tokenizer, ids, SamplingParams(stop=["cyan", "blue"]))
    first = min(i for i in (text.find("cyan"), text.find("blue")) if i >= 0)
    assert detok.text == text[:first] and stop == text[first:first + 4]
