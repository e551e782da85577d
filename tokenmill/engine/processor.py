"""Processor: a prompt (text, token ids or chat messages) + SamplingParams -> core Requests.

Validation of everything that depends on the model happens here, at the edge, with errors
that name the offending field.
"""

from __future__ import annotations

import random
import time
from typing import Any, Union

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

PromptInput = Union[str, list[int], dict[str, Any]]


def _child_seed(seed: int, index: int) -> int:
    return seed if index == 0 else (seed * 1_000_003 + index) % (2 ** 63 - 1)


class Processor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: frozenset[int], seed: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._seeds = random.Random(seed)

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """-> (prompt text if given, prompt token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise ValueError("prompt: must be a string, a list of token ids, or a dict with "
                         "'prompt' or 'prompt_token_ids'")

    def chat_prompt(self, messages: list[dict]) -> tuple[str, list[int]]:
        text = self.tokenizer.render_chat(messages)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt: token ids must be a list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return list(ids)

    def make_requests(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
                      arrival_time: float | None = None) -> list[Request]:
        """One core request per sequence (n > 1 siblings share the prompt's KV blocks)."""
        max_tokens = self._max_tokens(len(prompt_token_ids), params)
        params.validate_tokens(self.vocab_size)
        if not isinstance(priority, int):
            raise ValueError("priority: must be an integer")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        ids = [request_id] if params.n == 1 else [f"{request_id}:{i}" for i in range(params.n)]
        return [Request(rid, list(prompt_token_ids), params, self.eos_token_ids,
                        _child_seed(seed, i), max_tokens, priority, arrival, cache_salt,
                        prompt_source_id=ids[0] if i else None)
                for i, rid in enumerate(ids)]

    def _max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        if num_prompt == 0:
            raise ValueError("prompt: must not be empty")
        room = self.max_model_len - num_prompt
        if room < 1:
            raise ValueError(f"prompt: {num_prompt} tokens leave no room to generate within "
                             f"max_model_len {self.max_model_len}")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(f"max_tokens: {params.max_tokens} is too large: the prompt has "
                             f"{num_prompt} tokens and max_model_len is {self.max_model_len}, "
                             f"so at most {room} can be generated")
        return params.max_tokens
