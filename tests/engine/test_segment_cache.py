"""The segment cache encodes every text exactly as the tokenizer does, cached or not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from tokenmill.engine.segment_cache import SegmentCache
from tokenmill.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer(default_model.tokenizer_dir)


def plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def check_integrity(cache: SegmentCache) -> None:
    assert cache.num_tokens == sum(len(ids) for ids in cache.entries.values())
    assert cache.num_tokens <= cache.max_tokens
    assert all(len(piece) >= cache.min_chars for piece in cache.entries)


# pieces chosen to meet at the tokenizer's edges: special tokens beside spaces and newlines,
# words split across pieces, multi-byte characters
PIECES = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "|>",
                          " ", "  ", "\n", "\n\n", "\t", "system", "user", "Hello", " world",
                          "don't", "1234", "é", "中文", "🙂", ".", "<", "<|"])
TEXTS = st.lists(PIECES, max_size=30).map("".join)


@settings(max_examples=60, deadline=None)
@given(st.lists(TEXTS, min_size=1, max_size=8))
def test_every_text_encodes_as_the_tokenizer_does(tokenizer, texts):
    cache = SegmentCache(tokenizer.backend, max_tokens=40, min_chars=4)
    for text in texts + texts:          # the second pass meets its pieces in the cache
        assert cache.encode(text) == plain(tokenizer, text)
        check_integrity(cache)


def test_a_repeated_system_prompt_is_encoded_once(tokenizer):
    system = "You answer questions about the mill. " * 40
    first = tokenizer.render_chat([{"role": "system", "content": system},
                                   {"role": "user", "content": "Who built it?"}])
    second = tokenizer.render_chat([{"role": "system", "content": system},
                                    {"role": "user", "content": "When?"}])
    hits = tokenizer.segments.hits
    assert tokenizer.encode(first, add_special_tokens=False) == plain(tokenizer, first)
    assert tokenizer.encode(second, add_special_tokens=False) == plain(tokenizer, second)
    assert tokenizer.segments.hits == hits + 1
    # prompts (add_special_tokens=True) take the cache too: this tokenizer adds no ids
    assert tokenizer.encode(first) == tokenizer.backend.encode(first).ids
    assert tokenizer.segments.hits == hits + 2


def test_the_least_recently_used_piece_goes_first(tokenizer):
    a, b, c = ("alpha " * 60), ("bravo " * 60), ("charlie " * 60)
    size_a, size_b, size_c = (len(plain(tokenizer, text)) for text in (a, b, c))
    cache = SegmentCache(tokenizer.backend, max_tokens=max(size_a + size_b, size_a + size_c))
    for text in (a, b, a, c):
        assert cache.encode(text) == plain(tokenizer, text)
        check_integrity(cache)
    assert list(cache.entries) == [a, c]


def test_no_cache_where_cutting_at_added_tokens_is_not_exact():
    def backend(*tokens: AddedToken) -> HFTokenizer:
        made = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        made.add_special_tokens(list(tokens))
        return made
    assert SegmentCache.for_backend(backend()) is None
    assert SegmentCache.for_backend(backend(AddedToken("<s>", lstrip=True))) is None
    assert SegmentCache.for_backend(backend(AddedToken("<s>", normalized=True))) is None
    assert SegmentCache.for_backend(backend(AddedToken("<s>", normalized=False))) is not None
