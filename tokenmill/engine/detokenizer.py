"""Incremental, UTF-8-safe detokenization of one sequence, with exact stop-string truncation.

Text that could still turn out to be the start of a stop string is held back from streaming
until it is decided; the final text ends right before the stop string (or right after it with
include_stop_str_in_output).
"""

from __future__ import annotations

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams

_PREFIX_TOKENS = 4  # prompt tokens given as context, so the first pieces decode as they would inline


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._stream = tokenizer.decode_stream(prompt_token_ids[-_PREFIX_TOKENS:],
                                               params.skip_special_tokens)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._holdback = 0 if self._include_stop or not self._stops else max(
            len(s) for s in self._stops) - 1
        self.text = ""
        self.num_tokens = 0

    def update(self, token_ids: list[int]) -> tuple[str | None, int]:
        """Feed new tokens; returns (stop string hit or None, how many tokens were consumed)."""
        for consumed, token in enumerate(token_ids, start=1):
            before = len(self.text)
            piece = self._stream.step(self._tokenizer.backend, token)
            if piece:
                self.text += piece
            self.num_tokens += 1
            if self._stops and self.num_tokens >= self._min_tokens and piece:
                stop = self._truncate_at_stop(before)
                if stop is not None:
                    return stop, consumed
        return None, len(token_ids)

    def visible_text(self, finished: bool) -> str:
        if finished or not self._holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self._holdback)]

    def _truncate_at_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[:index + (len(stop) if self._include_stop else 0)]
        return stop
