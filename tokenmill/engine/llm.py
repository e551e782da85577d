"""LLM: the offline API. generate() and chat() run a batch to completion and return results
in input order, shaped as vLLM users know them."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.processor import PromptInput
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


def _as_list(value: Any, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: got {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        if model is not None:
            config["model"] = model
        self.engine = LLMEngine(EngineConfig.from_kwargs(**config))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] = 0, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Prompts: text, token ids, {"prompt": ...} or {"prompt_token_ids": ...} (optionally
        with "cache_salt", which keeps that request's cached prefix private), or a list."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = [{"prompt": p} for p in prompts]
        return self._run(items, sampling_params, priority, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        items = [{"messages": m} for m in conversations]
        return self._run(items, sampling_params, 0, use_tqdm)

    def _run(self, items: list[dict], sampling_params, priority, use_tqdm: bool
             ) -> list[RequestOutput]:
        params = _as_list(sampling_params or SamplingParams(), len(items), "sampling_params")
        priorities = _as_list(priority, len(items), "priority")
        ids = []
        try:
            for item, p, prio in zip(items, params, priorities):
                rid = self.engine.next_request_id()
                prompt = item.get("prompt")
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                self.engine.add_request(rid, prompt, p, item.get("messages"), prio, salt)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finished = {out.request_id: out for out in self._drain(len(ids), use_tqdm)}
        return [finished[rid] for rid in ids]

    def _drain(self, total: int, use_tqdm: bool) -> Iterator[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="requests", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    if bar:
                        bar.update(1)
                    yield out
        if bar:
            bar.close()

    def stream(self, prompt: PromptInput | None, sampling_params: SamplingParams,
               messages: list[dict] | None = None) -> Iterator[RequestOutput]:
        """Yield the growing output of one request after every step (for the CLI)."""
        rid = self.engine.next_request_id()
        self.engine.add_request(rid, prompt, sampling_params, messages)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            if self.engine.output_processor.has(rid):
                self.engine.abort_request(rid)
