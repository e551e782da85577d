"""EngineCore: the step loop. schedule -> worker.execute -> scheduler.update.

Each step's tokens (and how many were prompt work) and time are kept for the metrics
(SchedulerStats' last_step_*; `tokenmill:step_duration_seconds` and
`tokenmill:iteration_tokens_total`).

A failing forward pass finishes only the requests of that step, with an error; the engine
keeps serving the rest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.calibration import measure_fixed_rows
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
        self.last_scheduled: SchedulerOutput | None = None
        self._new_books()
        drafter = self._drafter() if config.speculative.num_speculative_tokens else None
        if drafter is not None:
            self._new_books(drafter)   # the step timing's requests leave no trace
        logger.info("%s", spec_summary(self.worker.spec))
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB) = %d tokens; max concurrency "
                    "at max_model_len %d: %.1fx", num_blocks, block_size,
                    num_blocks * self.worker.bytes_per_block / 1024 ** 3, capacity,
                    self.max_model_len, capacity / self.max_model_len)

    def _new_books(self, drafter: Drafter | None = None) -> None:
        num_blocks = self.worker.num_kv_blocks
        self.kv = KVCacheManager(num_blocks, self.config.cache.block_size,
                                 self.config.cache.prefix_cache)
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.max_model_len, drafter)
        self.num_steps = 0
        self.last_step = (0, 0, 0.0)   # tokens, of those prompt chunks', seconds

    def _drafter(self) -> Drafter:
        spec = self.config.speculative
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max)
        drafter = Drafter(proposer, adaptive=spec.draft_policy == "adaptive")
        if spec.draft_fixed_cost is not None:
            drafter.fixed_cost_rows = spec.draft_fixed_cost
        elif drafter.adaptive:
            measured = measure_fixed_rows(self)
            if measured is not None:
                drafter.fixed_cost_rows = measured
            logger.info("draft policy: a decode step's fixed cost is %.1f rows' worth (%s)",
                        drafter.fixed_cost_rows, "measured" if measured is not None else
                        "the default: too little room to measure it")
        return drafter

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish(self, request_ids: list[str], reason: FinishReason,
               stop_reason: str | int | None = None) -> None:
        self.scheduler.finish_requests(request_ids, reason, stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_steps = self.num_steps
        (stats.last_step_tokens, stats.last_step_prompt_tokens,
         stats.last_step_seconds) = self.last_step
        return stats

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.last_scheduled = scheduled  # read by benchmarks for per-step figures
        if scheduled.is_empty and not scheduled.finished_request_ids:
            return []
        try:
            result = self.worker.execute(scheduled)
        except Exception as exc:  # a failed forward must not take the other requests down
            logger.exception("engine step failed")
            return self._fail(list(scheduled.num_scheduled_tokens), exc)
        outputs = self.scheduler.update(scheduled, result)
        if not scheduled.is_empty:
            self._count_step(scheduled, time.perf_counter() - start)
        return outputs

    def _count_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """The step's tokens and time; prompt tokens are those of requests new to the batch
        or computing more than one token besides their drafts (SchedulerOutput.is_decode_only's
        prompt work)."""
        drafts = scheduled.draft_token_ids
        new = {request.request_id for request in scheduled.new_requests}
        tokens = prompt = 0
        for request_id, num in scheduled.num_scheduled_tokens.items():
            tokens += num
            if request_id in new or num > 1 + len(drafts.get(request_id, ())):
                prompt += num
        self.num_steps += 1
        self.last_step = (tokens, prompt, seconds)

    def _fail(self, request_ids: list[str], exc: Exception) -> list[EngineCoreOutput]:
        self.scheduler.finish_requests(request_ids, FinishReason.ERROR)
        message = f"{type(exc).__name__}: {exc}"
        return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=message)
                for rid in request_ids]

