"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat).

A View belongs to one HTTP request. For streaming it remembers how much of each choice it has
sent, since RequestOutputs are cumulative snapshots and chunks carry deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                       ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob,
                                       CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse, DeltaMessage, PromptTokensDetails,
                                       TopLogprob, Usage)


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _reason(choice: CompletionOutput) -> str | None:
    return str(choice.finish_reason) if choice.finish_reason is not None else None


def _top(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    """The n most likely tokens at a position (the chosen token is entry's first key)."""
    return sorted(entry.values(), key=lambda lp: lp.rank)[:n]


def _chosen(entry: dict[int, Logprob]) -> Logprob:
    return next(iter(entry.values()))


@dataclass
class _Sent:
    text: int = 0
    logprobs: int = 0
    done: bool = False
    started: bool = False   # a chunk went out (completions echo the prompt in the first)


class View:
    def __init__(self, base_id: str, model: str, n: int) -> None:
        self.base_id, self.model, self.n = base_id, model, n
        self._sent: dict[int, _Sent] = {}

    def start(self, num_prompts: int) -> list[BaseModel]:
        return []

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]:
        """Delta chunks for what `out` adds over what was sent before."""
        result = []
        for choice in out.outputs:
            index = prompt_index * self.n + choice.index
            sent = self._sent.setdefault(index, _Sent())
            if sent.done:
                continue
            text = choice.text[sent.text:]
            logprobs = (choice.logprobs or [])[sent.logprobs:]
            sent.done = choice.finished
            if text or logprobs or sent.done:
                result.append(self._chunk(index, text, logprobs, _reason(choice), out, sent))
                sent.started = True
            sent.text = max(sent.text, len(choice.text))
            sent.logprobs += len(logprobs)
        return result

    def _chunk(self, index: int, text: str, logprobs: list[dict[int, Logprob]],
               reason: str | None, out: RequestOutput, sent: _Sent) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, outputs: list[RequestOutput]) -> BaseModel:
        raise NotImplementedError


class CompletionView(View):
    def __init__(self, tokenizer: Tokenizer, base_id: str, model: str,
                 req: CompletionRequest, n: int) -> None:
        super().__init__(base_id, model, n)
        self.tokenizer, self.echo, self.num_logprobs = tokenizer, req.echo, req.logprobs

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _logprobs(self, entries: list[dict[int, Logprob] | None], offset: int
                  ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for entry in entries:
            if entry is None:  # the first prompt token has no logprob
                result.tokens.append("")
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = _chosen(entry)
                result.tokens.append(chosen.decoded_token or "")
                result.token_logprobs.append(chosen.logprob)
                result.top_logprobs.append({lp.decoded_token or "": lp.logprob
                                            for lp in _top(entry, self.num_logprobs)})
            result.text_offset.append(offset)
            offset += len(result.tokens[-1])
        return result

    def _chunk(self, index, text, logprobs, reason, out, sent) -> BaseModel:
        if self.echo and not sent.started:
            text = self._prompt_text(out) + text
        lp = self._logprobs(logprobs, sent.text) if self.num_logprobs is not None else None
        return CompletionResponse(id=self.base_id, model=self.model, choices=[
            CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=reason)])

    def usage_chunk(self, outputs: list[RequestOutput]) -> BaseModel:
        return CompletionResponse(id=self.base_id, model=self.model, choices=[],
                                  usage=usage(outputs))

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            prefix = self._prompt_text(out) if self.echo else ""
            for choice in out.outputs:
                lp = None
                if self.num_logprobs is not None:
                    entries = (list(out.prompt_logprobs or []) if self.echo else []) + list(
                        choice.logprobs or [])
                    lp = self._logprobs(entries, 0)
                choices.append(CompletionChoice(index=i * self.n + choice.index,
                                                text=prefix + choice.text, logprobs=lp,
                                                finish_reason=_reason(choice)))
        return CompletionResponse(id=self.base_id, model=self.model, choices=choices,
                                  usage=usage(outputs))


class ChatView(View):
    def __init__(self, base_id: str, model: str, req: ChatCompletionRequest, n: int) -> None:
        super().__init__(base_id, model, n)
        self.num_logprobs = (req.top_logprobs or 0) if req.logprobs else None

    def _logprobs(self, entries: list[dict[int, Logprob]]) -> ChatLogprobs:
        content = []
        for entry in entries:
            chosen = _chosen(entry)
            tops = [_top_logprob(lp) for lp in _top(entry, self.num_logprobs)]
            content.append(ChatTokenLogprob(**_top_logprob(lp=chosen).model_dump(),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)

    def start(self, num_prompts: int) -> list[BaseModel]:
        # The role comes first, at once: it also sends the headers before the first token.
        return [ChatCompletionChunk(id=self.base_id, model=self.model, choices=[
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(num_prompts * self.n)]

    def _chunk(self, index, text, logprobs, reason, out, sent) -> BaseModel:
        lp = self._logprobs(logprobs) if self.num_logprobs is not None and logprobs else None
        return ChatCompletionChunk(id=self.base_id, model=self.model, choices=[
            ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=lp,
                            finish_reason=reason)])

    def usage_chunk(self, outputs: list[RequestOutput]) -> BaseModel:
        return ChatCompletionChunk(id=self.base_id, model=self.model, choices=[],
                                   usage=usage(outputs))

    def response(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=choice.index, message=AssistantMessage(content=choice.text),
                              logprobs=(self._logprobs(choice.logprobs or [])
                                        if self.num_logprobs is not None else None),
                              finish_reason=_reason(choice))
                   for out in outputs for choice in out.outputs]
        return ChatCompletionResponse(id=self.base_id, model=self.model, choices=choices,
                                      usage=usage(outputs))


def _top_logprob(lp: Logprob) -> TopLogprob:
    token = lp.decoded_token or ""
    return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode("utf-8")))
