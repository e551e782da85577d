"""Request: the scheduler's view of one generation (one sequence). Leaf module."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.outputs import FinishReason
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"    # waiting again after its blocks were taken back
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int
    max_tokens: int                       # resolved: never beyond max_model_len
    priority: int = 0                     # lower runs first (priority policy)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None         # keeps this request's cached prefix private
    # n > 1: the sibling whose prompt blocks this request may share once they are computed.
    prompt_source_id: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output ids; read-only by convention (append through append_token)."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After a new token: set the finish reason if it ends the request."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                self.finish(FinishReason.STOP, stop_reason=last)
                return True
            if last in self.eos_token_ids and not params.ignore_eos:
                self.finish(FinishReason.STOP)
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
