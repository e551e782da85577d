"""The per-step contracts (SchedulerOutput, RunnerOutput) and the user-facing results.

Plain dataclasses, cheap to pickle to another process. Leaf module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token or a stop string
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # the engine failed while running it

    def __str__(self) -> str:
        return self.value


# ---- scheduler -> worker -------------------------------------------------------------------

@dataclass
class NewRequestData:
    """A request the worker has not seen (or has dropped after a preemption)."""
    request_id: str
    token_ids: list[int]          # prompt + outputs so far (a resumed request recomputes them)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int                     # effective seed; token i is drawn with (seed, i)
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed."""
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]     # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_request_ids: set[str]           # drop these from the worker's state
    num_preemptions: int = 0
    # request id -> draft tokens to check after its last sampled token (the step computes
    # 1 + len(drafts) tokens for it and samples at each; speculative decoding)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def is_decode_only(self) -> bool:
        """Every request computes its one new token (and its drafts): no prompt work."""
        return (not self.is_empty and not self.new_requests
                and all(n == 1 + len(self.draft_token_ids.get(rid, ()))
                        for rid, n in self.num_scheduled_tokens.items()))


# ---- worker -> scheduler -------------------------------------------------------------------

@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token first, then the top-N."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class RunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]       # per request; empty while its prompt is chunked
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


# ---- engine -> user ------------------------------------------------------------------------

@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None     # the stop string or stop token that ended it
    error: str | None = None                 # why the engine failed it (FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0


# ---- engine core -> frontend (output processor) --------------------------------------------

@dataclass
class EngineCoreOutput:
    """What happened to one request in one step."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None
