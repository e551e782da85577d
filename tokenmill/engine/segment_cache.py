"""Prompt encoding with the text between special tokens cached, exactly as one encode.

A fast tokenizer cuts its input at its added tokens before it normalizes or pre-tokenizes, so
a text's ids are its pieces' ids in order. Chat prompts repeat long pieces request after
request (a system prompt, a conversation's earlier turns), and tokenizing runs on the engine
thread between steps, where it holds up every running request. Here a long piece's ids come
from an LRU cache and only new pieces are encoded.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

MIN_CACHED_CHARS = 256          # shorter pieces encode in microseconds: not worth an entry
DEFAULT_MAX_TOKENS = 1 << 18    # ids kept over all entries (a few MB)


class SegmentCache:
    """encode(text) == backend.encode(text, add_special_tokens=False).ids, with long pieces
    between added tokens remembered (least recently used dropped past max_tokens)."""

    def __init__(self, backend: Any, max_tokens: int = DEFAULT_MAX_TOKENS,
                 min_chars: int = MIN_CACHED_CHARS) -> None:
        added = backend.get_added_tokens_decoder()
        self.backend = backend
        self.max_tokens = max_tokens
        self.min_chars = min_chars
        self.token_ids = {token.content: token_id for token_id, token in added.items()}
        # longest first: at one position the regex takes the first alternative, the tokenizer
        # the longest match
        contents = sorted(self.token_ids, key=len, reverse=True)
        self.splitter = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
        self.entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0
        self.lock = threading.Lock()   # the server's /tokenize runs on another thread

    @classmethod
    def for_backend(cls, backend: Any, **kwargs: Any) -> SegmentCache | None:
        """A cache for this tokenizer, or None where cutting at added tokens is not exactly
        what the tokenizer does (tokens that strip or match normalized text, or none)."""
        added = backend.get_added_tokens_decoder().values()
        if not added or getattr(backend, "encode_special_tokens", False):
            return None
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
            return None
        return cls(backend, **kwargs)

    def encode(self, text: str) -> list[int]:
        pieces = self.splitter.split(text)
        if all(len(piece) < self.min_chars for piece in pieces[::2]):
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:                      # an added token, as the splitter captured it
                ids.append(self.token_ids[piece])
            elif len(piece) >= self.min_chars:
                ids.extend(self._cached(piece))
            elif piece:
                ids.extend(self.backend.encode(piece, add_special_tokens=False).ids)
        return ids

    def _cached(self, piece: str) -> tuple[int, ...]:
        with self.lock:
            ids = self.entries.get(piece)
            if ids is not None:
                self.entries.move_to_end(piece)
                self.hits += 1
                return ids
        ids = tuple(self.backend.encode(piece, add_special_tokens=False).ids)
        with self.lock:
            if piece not in self.entries and len(ids) <= self.max_tokens:
                self.entries[piece] = ids
                self.num_tokens += len(ids)
                while self.num_tokens > self.max_tokens:
                    _, dropped = self.entries.popitem(last=False)
                    self.num_tokens -= len(dropped)
        return ids
