"""Stats objects the engine publishes each step; exporters (Prometheus, bench) read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0          # fraction of blocks held by requests
    num_preemptions: int = 0             # total since start
    prefix_cache_queries: int = 0        # prompt tokens looked up, total
    prefix_cache_hits: int = 0           # of those, found cached
    prefix_cache_evicted_blocks: int = 0
    prefix_cache_blocks: int = 0         # blocks currently cached in the tree
    spec_draft_tokens: int = 0           # draft tokens checked by the model, total
    spec_accepted_tokens: int = 0        # of those, the sampler's own choice (kept)
    spec_step_fixed_rows: float = 0.0    # a decode step's fixed cost in rows, as the draft
                                         # policy weighs it (0 without drafts)
    num_steps: int = 0                   # engine steps that ran the model, total
    last_step_tokens: int = 0            # the last of them: tokens computed,
    last_step_prompt_tokens: int = 0     # of those, prompt chunks' (0: a decode-only step),
    last_step_seconds: float = 0.0       # and its time, schedule to update

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
