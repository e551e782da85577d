"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

Each step has a budget of `max_num_batched_tokens`. Running requests are served first (a
decode costs one token, an unfinished prompt continues with its next chunk), then waiting
requests are admitted while budget, `max_num_seqs` and KV blocks allow. When blocks run out,
the lowest-priority, latest-arrived running request is preempted: its blocks are freed (its
full blocks stay in the prefix cache) and it is recomputed from its tokens when it resumes.
With `unchunked_prefill_min`, a prompt with that many tokens left is computed in one step,
whatever the budget. With `idle_batched_tokens` (by default 512 under a budget of 2048), a
step in which no running request has output yet takes that budget. Larger than the budget,
prompts that arrive together share one step; smaller, the first step of a burst is short, so
the head of the queue answers soon, and once it streams the rest of the burst goes in steps of
the full budget. The head's own prompt is not cut by the smaller idle budget (a step takes as
much of it as a step of the full budget would): cutting it would only delay its first token,
and the requests that wait for its prefix. With a drafter (speculative decoding), a decoding
request in a step without prompt work computes its last token and the drafts the drafter chose
for it (spec/drafter.py) in one step; the worker samples at each and keeps the drafts up to
the first that differs from the sampled token, and `update` takes the rejected drafts'
positions back from num_computed_tokens.

Pure Python over ints and lists: no torch, no model.
"""

from __future__ import annotations

import time

from tokenmill.config import SchedulerConfig
from tokenmill.core.admission import AdmissionOrder, prefix_in_flight
from tokenmill.core.queue import WaitingQueue
from tokenmill.core.step_plan import StepPlan
from tokenmill.kv.manager import NO_MATCH, KVCacheManager
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import (CachedRequestData, EngineCoreOutput, FinishReason, NewRequestData,
                               RunnerOutput, SchedulerOutput)
from tokenmill.request import Request, RequestStatus
from tokenmill.spec.drafter import Drafter


def _is_prefilling(request: Request) -> bool:
    return request.num_tokens - request.num_computed_tokens > 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter          # None: no speculative decoding
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._dropped_ids: set[str] = set()   # the worker must forget these at the next step
        self.admission = AdmissionOrder(config.policy, kv)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], reason: FinishReason,
                        stop_reason: str | int | None = None) -> list[Request]:
        """End requests from outside the step (abort, stop string, error)."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish(reason, stop_reason)
            self._release(request)
            finished.append(request)
        return finished

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def stats(self) -> SchedulerStats:
        prefix = self.kv.stats
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            prefix_cache_evicted_blocks=prefix.evicted_blocks,
            prefix_cache_blocks=self.kv.tree.num_cached_blocks,
            spec_draft_tokens=self.drafter.num_draft_tokens if self.drafter else 0,
            spec_accepted_tokens=self.drafter.num_accepted_tokens if self.drafter else 0,
            spec_step_fixed_rows=self.drafter.fixed_cost_rows if self.drafter else 0.0)

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        order = self.admission.order(self.waiting)
        plan = self._new_plan(order)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan, order)
        # No drafts beside prompt work: they would lengthen a step that a prompt's first
        # token waits for, and the prompt's rows keep that step busy enough anyway.
        if self.drafter is not None and not plan.preempted and not plan.has_prompt_work:
            self._add_drafts(plan)
        return self._emit(plan)

    def _new_plan(self, order: list[Request]) -> StepPlan:
        """This step's token budget and chunk caps; `order`: the waiting requests in the
        order they will be tried."""
        config = self.config
        full, idle = config.max_num_batched_tokens, config.idle_batched_tokens
        if not idle or any(r.num_output_tokens for r in self.running):
            return StepPlan(full, config.chunk_cap)
        plan = StepPlan(idle, min(config.max_prefill_chunk or idle, idle))
        if idle < full:
            # The smaller budget bounds the prompts that join the head of the queue, not the
            # head's own: it takes a full step's chunk (cut, shared_prefix's first prompt
            # took three steps while the requests behind it waited for its prefix).
            plan.head = next((r for r in self.running if _is_prefilling(r)),
                             order[0] if order else None)
            plan.head_cap = config.chunk_cap
        return plan

    def _chunk(self, request: Request, plan: StepPlan) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        whole_from = self.config.unchunked_prefill_min
        if whole_from and remaining >= whole_from:
            return remaining   # past the budget: the step ends with this request
        if request is plan.head:
            return min(remaining, plan.head_cap)   # past the idle budget, if it must
        return min(remaining, plan.chunk_cap, plan.budget)

    def _schedule_running(self, plan: StepPlan) -> None:
        # Decodes first: a prompt admitted in an idle step may still be prefilling when
        # requests admitted with it already decode, and its chunk must not starve them.
        for request in sorted(self.running, key=_is_prefilling):
            if plan.budget <= 0 and request is not plan.head:
                continue
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(request, plan)
            if num_new <= 0:
                continue
            blocks = self._allocate_or_preempt(request, num_new, plan)
            if blocks is not None:
                plan.add(request, num_new, blocks)

    def _add_drafts(self, plan: StepPlan) -> None:
        """Draft tokens for a decode-only step's requests, within its token budget, as the
        drafter chooses them. Never preempts: drafts are a bet, not a need."""
        admitted = {r.request_id for r in plan.new_requests}
        proposals = {}
        for request in self.running:
            if (plan.num_tokens.get(request.request_id) != 1 or request.request_id in admitted
                    or request.num_tokens - request.num_computed_tokens != 1):
                continue
            room = min(request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1, plan.budget)
            drafts = self.drafter.propose(request.request_id, request.all_token_ids, room)
            if drafts:
                proposals[request.request_id] = drafts
        chosen = self.drafter.choose(proposals, len(plan.num_tokens), plan.budget)
        for request_id, drafts in chosen.items():
            request = self.requests[request_id]
            blocks = self.kv.allocate(request, 1 + len(drafts))
            if blocks is not None:
                plan.add_drafts(request, drafts, blocks)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             plan: StepPlan) -> list[int] | None:
        while True:
            blocks = self.kv.allocate(request, num_new)
            if blocks is not None:
                return blocks
            # Ties (n > 1 siblings share an arrival time) take the latest admitted: taking the
            # first let two siblings preempt each other in turn forever.
            victim = max(reversed(self.running), key=self._victim_key)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _victim_key(self, request: Request) -> tuple:
        priority = request.priority if self.config.policy == "priority" else 0
        return (priority, request.arrival_time)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        plan.drop(request)
        self.kv.commit(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)
        self._dropped_ids.add(request.request_id)
        plan.preempted.append(request)

    def _schedule_waiting(self, plan: StepPlan, order: list[Request]) -> None:
        for position, request in enumerate(order):
            if ((plan.budget <= 0 and request is not plan.head)
                    or len(self.running) >= self.config.max_num_seqs):
                return
            if (self._waits_for_source(request)
                    or prefix_in_flight(self.kv, request, self.running)):
                continue
            if not self._admit(request, plan) and not self._preempt_for(request, plan):
                return
            self.admission.admitted(request, order[:position], self.waiting)

    def _waits_for_source(self, request: Request) -> bool:
        """An n > 1 sibling waits until the prompt it shares has been computed once."""
        source = self.requests.get(request.prompt_source_id or "")
        return (source is not None and not source.is_finished
                and source.num_computed_tokens < source.num_prompt_tokens)

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        source = self.requests.get(request.prompt_source_id or "")
        match = self.kv.lookup(request, source) if source or self.kv.prefix_cache else NO_MATCH
        num_cached = match.num_tokens(self.kv.block_size)
        request.num_computed_tokens = num_cached
        num_new = self._chunk(request, plan)
        blocks = self.kv.allocate(request, num_new, match)
        if blocks is None:
            request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        self.running.append(request)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_cached
        if self.kv.prefix_cache:
            self.kv.stats.record_lookup(request.num_tokens, num_cached)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        plan.add(request, num_new, list(self.kv.block_ids(request.request_id)))
        plan.new_requests.append(request)
        return True

    def _preempt_for(self, request: Request, plan: StepPlan) -> bool:
        """Priority policy: a waiting request may take the blocks of lower-priority runners."""
        if self.config.policy != "priority":
            return False
        while True:
            victims = [r for r in self.running if self._victim_key(r) > self._victim_key(request)]
            if not victims:
                return False
            self._preempt(max(reversed(victims), key=self._victim_key), plan)
            if self._admit(request, plan):
                return True

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        new_ids = {r.request_id for r in plan.new_requests}
        new_data, cached_data = [], []
        for request in self.running:
            rid = request.request_id
            if rid not in plan.num_tokens:
                continue
            if rid in new_ids:
                new_data.append(NewRequestData(
                    rid, list(request.all_token_ids), request.num_prompt_tokens,
                    request.sampling_params, request.seed, list(plan.new_blocks[rid]),
                    request.num_computed_tokens))
            else:
                cached_data.append(CachedRequestData(rid, plan.new_blocks[rid],
                                                     request.num_computed_tokens))
            request.num_computed_tokens += plan.num_tokens[rid]
        dropped, self._dropped_ids = self._dropped_ids, set()
        return SchedulerOutput(new_data, cached_data, dict(plan.num_tokens),
                               sum(plan.num_tokens.values()), dropped, len(plan.preempted),
                               plan.drafts)

    # ---- results -------------------------------------------------------------------------

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests, cache newly full blocks."""
        outputs = []
        now = time.monotonic()
        for rid, token_ids in zip(result.req_ids, result.sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            num_drafts = len(scheduled.draft_token_ids.get(rid, ()))
            if num_drafts:
                # the step computed every draft's position; those after the first rejection
                # hold keys and values of tokens the request does not have (overwritten later)
                request.num_computed_tokens -= num_drafts - (len(token_ids) - 1)
            if self.drafter is not None:
                self.drafter.record(rid, num_drafts, token_ids)
            kept = []
            for token in token_ids:
                request.append_token(token)
                kept.append(token)
                if request.first_token_time is None:
                    request.first_token_time = now
                if request.check_stop(self.max_model_len):
                    # stopped inside its kept drafts: the positions after the stop hold keys
                    # and values of tokens the request never took
                    request.num_computed_tokens = min(request.num_computed_tokens,
                                                      request.num_tokens - 1)
                    break
            self.kv.commit(request)
            prompt_logprobs = result.prompt_logprobs.get(rid)
            if kept or prompt_logprobs:
                outputs.append(self._core_output(request, kept, result, prompt_logprobs))
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
        return outputs

    def _core_output(self, request: Request, kept: list[int], result: RunnerOutput,
                     prompt_logprobs) -> EngineCoreOutput:
        logprobs = result.logprobs.get(request.request_id)
        return EngineCoreOutput(
            request.request_id, kept, logprobs[:len(kept)] if logprobs else None,
            prompt_logprobs, request.finish_reason, request.stop_reason,
            request.num_cached_tokens, request.first_scheduled_time, request.num_preemptions)

    def _release(self, request: Request) -> None:
        self.kv.commit(request)
        self.kv.free(request)
        self._dropped_ids.add(request.request_id)
        self.admission.forget(request.request_id)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        del self.requests[request.request_id]
