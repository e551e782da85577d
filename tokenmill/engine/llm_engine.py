"""LLMEngine: processor + engine core + output processor, stepped by its caller.

LLM (offline) drives it in a loop; AsyncLLM (the server) drives it from a background loop.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import Processor, PromptInput
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import FinishReason, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill import models_hub
        self.config = config
        source = models_hub.resolve(config.model.model)
        self.model_name = source.name
        self.tokenizer = Tokenizer(config.model.tokenizer or source.tokenizer_dir)
        eos = {self.tokenizer.eos_token_id} - {None}
        self.core = EngineCore(config, source.kind, source.path, frozenset(eos))
        spec = self.core.worker.spec
        self.max_model_len = self.core.max_model_len
        self.processor = Processor(self.tokenizer, self.max_model_len, spec.vocab_size,
                                   self.core.worker.eos_token_ids, config.model.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptInput | None, params: SamplingParams,
                    messages: list[dict] | None = None, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises ValueError naming the bad field."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")
        if messages is not None:
            text, ids = self.processor.chat_prompt(messages)
        else:
            text, ids = self.processor.tokenize(prompt)
        requests = self.processor.make_requests(request_id, ids, params, priority, cache_salt,
                                                arrival_time)
        self.output_processor.add(request_id, text, ids, params,
                                  [r.request_id for r in requests], requests[0].arrival_time)
        for request in requests:
            self.core.add_request(request)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                      error: str | None = None) -> RequestOutput | None:
        """End a request from outside the step (caller gone, or a failed engine loop)."""
        self.core.finish(self.output_processor.core_ids(request_id), reason)
        return self.output_processor.abort(request_id, reason, error)

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        for core_id, stop in stopped:
            self.core.finish([core_id], FinishReason.STOP, stop)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.kv.check_integrity()

    @property
    def kv_usage(self) -> float:
        return self.core.kv.usage

    def describe(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.max_model_len,
                "num_kv_blocks": self.core.kv.num_blocks,
                "block_size": self.config.cache.block_size}
