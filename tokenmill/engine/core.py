"""EngineCore: the step loop. schedule -> worker.execute -> scheduler.update.

A failing forward pass finishes only the requests of that step, with an error; the engine
keeps serving the rest.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.kv.manager import KVCacheManager
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import EngineCoreOutput, FinishReason, SchedulerOutput
from tokenmill.request import Request
from tokenmill.spec.drafter import Drafter
from tokenmill.spec.ngram import NgramProposer
from tokenmill.worker.worker import Worker, spec_summary

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, kind: str, path: Path,
                 eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.worker = Worker(config.model, config.cache, kind, path, eos_token_ids)
        self.max_model_len = self.worker.max_model_len
        block_size = config.cache.block_size
        num_blocks = self.worker.num_kv_blocks
        capacity = num_blocks * block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"kv_cache_memory: {num_blocks} blocks hold {capacity} tokens, fewer than "
                f"max_model_len {self.max_model_len}; give the KV cache more memory or lower "
                f"max_model_len")
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.prefix_cache)
        spec = config.speculative
        drafter = (Drafter(NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                         spec.prompt_lookup_max),
                           adaptive=spec.draft_policy == "adaptive")
                   if spec.num_speculative_tokens else None)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, drafter)
        self.last_scheduled: SchedulerOutput | None = None
        logger.info("%s", spec_summary(self.worker.spec))
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB) = %d tokens; max concurrency "
                    "at max_model_len %d: %.1fx", num_blocks, block_size,
                    num_blocks * self.worker.bytes_per_block / 1024 ** 3, capacity,
                    self.max_model_len, capacity / self.max_model_len)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish(self, request_ids: list[str], reason: FinishReason,
               stop_reason: str | int | None = None) -> None:
        self.scheduler.finish_requests(request_ids, reason, stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        self.last_scheduled = scheduled  # read by benchmarks for per-step figures
        if scheduled.is_empty and not scheduled.finished_request_ids:
            return []
        try:
            result = self.worker.execute(scheduled)
        except Exception as exc:  # a failed forward must not take the other requests down
            logger.exception("engine step failed")
            return self._fail(list(scheduled.num_scheduled_tokens), exc)
        return self.scheduler.update(scheduled, result)

    def _fail(self, request_ids: list[str], exc: Exception) -> list[EngineCoreOutput]:
        self.scheduler.finish_requests(request_ids, FinishReason.ERROR)
        message = f"{type(exc).__name__}: {exc}"
        return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=message)
                for rid in request_ids]

