"""OutputProcessor: engine-core token outputs -> user-facing RequestOutputs.

Holds, per user request, the detokenizer of each of its n sequences, the logprobs gathered so
far and the timing marks. A stop string found here ends the sequence; the engine then tells
the core to release it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.outputs import (CompletionOutput, EngineCoreOutput, FinishReason, Logprob,
                               RequestMetrics, RequestOutput, TokenLogprobs)
from tokenmill.sampling_params import SamplingParams


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.detokenizer.visible_text(self.finish_reason is not None),
            list(self.token_ids), self.cumulative_logprob,
            list(self.logprobs) if self.logprobs is not None else None,
            self.finish_reason, self.stop_reason, self.error)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, _Sequence]           # core request id -> sequence
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
            [s.output() for s in sorted(self.sequences.values(), key=lambda s: s.index)],
            self.finished, self.metrics, self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._owner: dict[str, str] = {}       # core request id -> user request id

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, core_ids: list[str], arrival_time: float) -> None:
        sequences = {cid: _Sequence(i, IncrementalDetokenizer(self.tokenizer, params,
                                                              prompt_token_ids),
                                    logprobs=[] if params.logprobs is not None else None,
                                    cumulative_logprob=0.0 if params.logprobs is not None
                                    else None)
                     for i, cid in enumerate(core_ids)}
        state = _RequestState(request_id, prompt, prompt_token_ids, params, sequences,
                              RequestMetrics(arrival_time))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self._states[request_id] = state
        for cid in core_ids:
            self._owner[cid] = request_id

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def core_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        return list(state.sequences) if state else []

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the changed requests' outputs and (core id, stop string) pairs to release."""
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            request_id = self._owner.get(out.request_id)
            if request_id is None:
                continue
            state = self._states[request_id]
            stop = self._apply(state, state.sequences[out.request_id], out, now)
            if stop is not None:
                stopped.append((out.request_id, stop))
            changed[request_id] = state
        return [self._emit(state) for state in changed.values()], stopped

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        for sequence in state.sequences.values():
            if sequence.finish_reason is None:
                sequence.finish_reason, sequence.error = reason, error
        return self._emit(state)

    def _apply(self, state: _RequestState, seq: _Sequence, out: EngineCoreOutput,
               now: float) -> str | None:
        metrics = state.metrics
        if out.first_scheduled_time and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        metrics.num_preemptions = max(metrics.num_preemptions, out.num_preemptions)
        if seq.index == 0:
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._logprob_dict(t) for t in out.new_prompt_logprobs)
        if out.new_token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        stop, consumed = seq.detokenizer.update(out.new_token_ids)
        seq.token_ids.extend(out.new_token_ids[:consumed])
        if seq.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs[:consumed]:
                seq.logprobs.append(self._logprob_dict(entry))
                seq.cumulative_logprob += entry.logprobs[0]
        if stop is not None:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            seq.error = out.error
        return stop

    def _emit(self, state: _RequestState) -> RequestOutput:
        output = state.output()
        if output.finished:
            state.metrics.finished_time = time.monotonic()
            del self._states[state.request_id]
            for cid in state.sequences:
                self._owner.pop(cid, None)
        return output

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for token, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token not in result:
                result[token] = Logprob(logprob, rank, self.tokenizer.decode([token], False))
        return result
