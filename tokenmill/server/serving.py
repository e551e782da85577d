"""Turns OpenAI requests into SamplingParams and AsyncLLM calls, and engine outputs into
responses and SSE chunks. The response shapes live in protocol.py, logprob rendering in
render.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from pydantic import BaseModel
from starlette.requests import Request as HTTPRequest

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.outputs import FinishReason, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import render
from tokenmill.server.errors import APIError, invalid
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       _SamplingRequest)

_DISCONNECT_POLL = 0.5   # seconds between client checks while a non-streaming request runs


@dataclass
class _Job:
    """One HTTP request's engine requests (one per prompt) and their latest outputs."""
    base_id: str
    request_ids: list[str]
    sink: asyncio.Queue
    latest: dict[str, RequestOutput]

    @property
    def finished(self) -> bool:
        return len(self.latest) == len(self.request_ids) and all(
            out.finished for out in self.latest.values())

    def prompt_index(self, request_id: str) -> int:
        return self.request_ids.index(request_id)


def sampling_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias or None, stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except ValueError as exc:
        raise invalid(exc) from None


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of text or token-id prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, max_num_waiting: int | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_num_waiting = max_num_waiting

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model: the model '{model}' does not exist; this server "
                           f"serves '{self.model_name}'", param="model", code="model_not_found")

    def admit(self) -> None:
        if self.max_num_waiting is not None and self.engine.num_waiting >= self.max_num_waiting:
            raise APIError(429, f"too many requests waiting ({self.engine.num_waiting}); "
                           "retry later", headers={"Retry-After": "1"})

    # ---- completions ---------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, http: HTTPRequest
                          ) -> BaseModel | AsyncIterator[str]:
        self.check_model(req.model)
        prompts = completion_prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo and not req.stream else None
        params = sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs)
        self.admit()
        job = await self._submit("cmpl", [(p, None) for p in prompts], params, req)
        view = render.CompletionView(self.engine.engine.tokenizer, job.base_id, self.model_name,
                                     req, params.n)
        if req.stream:
            return self._stream(job, view, req.include_usage)
        await self._wait(job, http)
        return view.response(self._final(job))

    # ---- chat ----------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest
                   ) -> BaseModel | AsyncIterator[str]:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true",
                           param="top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = sampling_params(req, max_tokens, logprobs)
        except APIError as exc:  # chat calls SamplingParams.logprobs "top_logprobs"
            if exc.param == "logprobs":
                exc.param = "top_logprobs"
            raise
        self.admit()
        messages = [m.model_dump() for m in req.messages]
        job = await self._submit("chatcmpl", [(None, messages)], params, req)
        view = render.ChatView(job.base_id, self.model_name, req, params.n)
        if req.stream:
            return self._stream(job, view, req.include_usage)
        await self._wait(job, http)
        return view.response(self._final(job))

    # ---- engine plumbing -----------------------------------------------------------------

    async def _submit(self, kind: str, items: list[tuple], params: SamplingParams,
                      req: _SamplingRequest) -> _Job:
        job = _Job(f"{kind}-{uuid.uuid4().hex}", [], asyncio.Queue(), {})
        try:
            for i, (prompt, messages) in enumerate(items):
                request_id = f"{job.base_id}-{i}"
                job.request_ids.append(request_id)
                await self.engine.add_request(request_id, prompt, params, job.sink,
                                              messages=messages, priority=req.priority,
                                              cache_salt=req.cache_salt)
        except BaseException as exc:  # rejected or cancelled: take back what was queued
            self._abort(job)
            if isinstance(exc, ValueError):
                raise invalid(exc) from None
            raise
        return job

    def _abort(self, job: _Job) -> None:
        for request_id in job.request_ids:
            out = job.latest.get(request_id)
            if out is None or not out.finished:
                self.engine.abort(request_id)

    async def _next(self, job: _Job) -> list[RequestOutput]:
        """Wait for news, then take everything queued, keeping each request's newest snapshot
        (outputs are cumulative, so a slow reader just skips intermediate ones)."""
        batch = {}
        out = await job.sink.get()
        while True:
            batch[out.request_id] = job.latest[out.request_id] = out
            if job.sink.empty():
                return list(batch.values())
            out = job.sink.get_nowait()

    async def _wait(self, job: _Job, http: HTTPRequest) -> None:
        """Run a non-streaming job to the end, aborting it if the client goes away."""
        try:
            last_check = time.monotonic()
            while not job.finished:
                try:
                    await asyncio.wait_for(self._next(job), _DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    pass
                # On a clock, not only on quiet spells: a request that streams tokens faster
                # than the poll interval must still notice its client leaving.
                if time.monotonic() - last_check >= _DISCONNECT_POLL:
                    last_check = time.monotonic()
                    if await http.is_disconnected():
                        raise asyncio.CancelledError
        finally:
            if not job.finished:
                self._abort(job)

    def _final(self, job: _Job) -> list[RequestOutput]:
        outputs = [job.latest[rid] for rid in job.request_ids]
        for out in outputs:
            error = _error_of(out)
            if error:
                raise APIError(500, error)
        return outputs

    async def _stream(self, job: _Job, view: "render.View", include_usage: bool
                      ) -> AsyncIterator[str]:
        """SSE body. Cancelled by Starlette when the client disconnects -> abort."""
        try:
            for chunk in view.start(len(job.request_ids)):
                yield _sse(chunk)
            while not job.finished:
                for out in await self._next(job):
                    error = _error_of(out)
                    if error:
                        yield _sse(APIError(500, error).body())
                        yield "data: [DONE]\n\n"
                        return
                    for chunk in view.chunks(job.prompt_index(out.request_id), out):
                        yield _sse(chunk)
            if include_usage:
                yield _sse(view.usage_chunk([job.latest[rid] for rid in job.request_ids]))
            yield "data: [DONE]\n\n"
        finally:
            self._abort(job)


def _error_of(out: RequestOutput) -> str | None:
    for choice in out.outputs:
        if choice.finish_reason == FinishReason.ERROR:
            return f"the engine failed this request: {choice.error}"
    return None


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"

