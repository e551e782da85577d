"""SamplingParams: how one request's tokens are chosen and when it stops. Leaf module."""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_LOGPROBS = 20


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: until max_model_len
    min_tokens: int = 0
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None          # top-N logprobs per output token
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False)  # room for later features

    def __post_init__(self) -> None:
        # Accept lists / single strings from callers but store immutable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias:
            object.__setattr__(self, "logit_bias",
                               {int(k): float(v) for k, v in self.logit_bias.items()})
        self.validate()

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k",
               f"must be -1, 0 (off) or >= 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= _MAX_LOGPROBS, name,
                   f"must be in [0, {_MAX_LOGPROBS}], got {value}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        for token, bias in (self.logit_bias or {}).items():
            _check(-100 <= bias <= 100, "logit_bias", f"bias for token {token} must be in "
                   f"[-100, 100], got {bias}")

    def validate_tokens(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        for token in self.stop_token_ids:
            _check(0 <= token < vocab_size, "stop_token_ids",
                   f"token id {token} is outside the vocabulary [0, {vocab_size})")
        for token in self.logit_bias or {}:
            _check(0 <= token < vocab_size, "logit_bias",
                   f"token id {token} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)
