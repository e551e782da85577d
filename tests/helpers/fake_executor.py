"""A scripted fake executor and a scheduler harness, for scheduler tests without a model.

The fake executor behaves like a worker: it keeps each request's token list (from
NewRequestData plus its own samples), forgets requests named in `finished_request_ids`, and
"samples" a deterministic next token, `sum(tokens) % 100 + 3`, once a request's computed tokens
reach its full length. It also simulates the paged KV cache: every computed token is written to
its slot through the block table, and every step "attends" over all earlier positions, checking
that the slots still hold the request's own tokens. So a block handed to two requests, a cached
prefix with the wrong content, or an overwritten shared block all show up as wrong reads.
Draft tokens (speculative decoding) are written and read like the others, sampled after at
each position, and kept up to the first that differs, as the model runner does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tokenmill.config import SchedulerConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.kv.manager import KVCacheManager
from tokenmill.outputs import FinishReason, RunnerOutput, SchedulerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sample.speculative import kept_tokens
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.drafter import Drafter

BS = 4


def next_token(tokens: list[int]) -> int:
    return sum(tokens) % 100 + 3


def expected_output(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    """What any correct schedule must produce: the unconstrained run, computed directly."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token == eos:
            break
    return out


def make_request(rid: str, prompt: list[int], max_tokens: int, arrival: float,
                 priority: int = 0, source: str | None = None, eos: int | None = None,
                 salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=eos is None)
    return Request(rid, list(prompt), params,
                   frozenset() if eos is None else frozenset({eos}), seed=0,
                   max_tokens=max_tokens, priority=priority, arrival_time=arrival,
                   cache_salt=salt, prompt_source_id=source)


class ScriptedProposer:
    """Drafts that are right up to a scripted mistake: the true continuation (next_token),
    with the draft at every `wrong_every`-th position changed, so steps accept all, some or
    none of their drafts."""

    def __init__(self, num_tokens: int = 3, wrong_every: int = 5) -> None:
        self.num_tokens, self.wrong_every = num_tokens, wrong_every
        self.forgotten: list[str] = []

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        context, drafts = list(token_ids), []
        for _ in range(min(self.num_tokens, max_tokens)):
            token = next_token(context)
            if len(context) % self.wrong_every == 0:
                token += 1
            drafts.append(token)
            context.append(token)
        return drafts

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


@dataclass
class _WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeExecutor:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.states: dict[str, _WorkerState] = {}
        self.kv_slots: dict[int, int] = {}       # slot -> token id written there

    def _slot(self, state: _WorkerState, position: int) -> int:
        block = state.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        for rid in scheduled.finished_request_ids:
            self.states.pop(rid, None)
        for data in scheduled.new_requests:
            assert data.request_id not in self.states
            self.states[data.request_id] = _WorkerState(
                list(data.token_ids), list(data.block_ids), data.num_computed_tokens)
        for data in scheduled.cached_requests:
            state = self.states[data.request_id]
            assert state.num_computed_tokens == data.num_computed_tokens
            state.block_ids.extend(data.new_block_ids)
        drafts = scheduled.draft_token_ids
        for rid, tokens in drafts.items():
            state = self.states[rid]
            assert len(state.token_ids) - state.num_computed_tokens == 1, "drafts of a prompt"
            state.token_ids.extend(tokens)
        self._check_block_tables()
        written: dict[int, str] = {}
        for rid, num in scheduled.num_scheduled_tokens.items():     # write K/V first ...
            state = self.states[rid]
            start = state.num_computed_tokens
            assert num >= 1 and start + num <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= start + num
            for position in range(start, start + num):
                slot = self._slot(state, position)
                assert slot not in written, f"{rid} and {written[slot]} write slot {slot}"
                written[slot] = rid
                self.kv_slots[slot] = state.token_ids[position]
        req_ids, sampled = [], []
        for rid, num in scheduled.num_scheduled_tokens.items():     # ... then attend
            state = self.states[rid]
            state.num_computed_tokens += num
            for position in range(state.num_computed_tokens):
                assert self.kv_slots.get(self._slot(state, position)) == \
                    state.token_ids[position], f"{rid} reads a wrong KV at {position}"
            req_ids.append(rid)
            if state.num_computed_tokens == len(state.token_ids):
                sampled.append(self._sample(state, drafts.get(rid, [])))
            else:
                sampled.append([])                                  # prompt still chunked
        return RunnerOutput(req_ids, sampled)

    @staticmethod
    def _sample(state: _WorkerState, drafts: list[int]) -> list[int]:
        base = len(state.token_ids) - len(drafts)
        tokens = [next_token(state.token_ids[:base + j]) for j in range(len(drafts) + 1)]
        kept = kept_tokens(tokens, drafts)
        del state.token_ids[base:]
        state.token_ids.extend(kept)
        state.num_computed_tokens -= len(drafts) - (len(kept) - 1)
        return kept

    def _check_block_tables(self) -> None:
        """Blocks a request writes to (past its computed full blocks) belong to it alone."""
        owner: dict[int, str] = {}
        for rid, state in self.states.items():
            first_open = state.num_computed_tokens // self.block_size
            for block in state.block_ids[first_open:]:
                assert block not in owner, f"block {block} is writable by {rid} and {owner[block]}"
                owner[block] = rid
        for rid, state in self.states.items():
            first_open = state.num_computed_tokens // self.block_size
            for block in state.block_ids[:first_open]:
                assert owner.get(block, rid) == rid, f"block {block} of {rid} can be overwritten"


class Harness:
    """Scheduler + KV manager + fake executor, with the per-step checks."""

    def __init__(self, num_blocks: int = 64, prefix_cache: bool = True, max_model_len: int = 256,
                 block_size: int = BS, proposer=None, adaptive_drafts: bool = False,
                 **scheduler_options) -> None:
        self.config = SchedulerConfig(**scheduler_options)
        self.kv = KVCacheManager(num_blocks, block_size, prefix_cache)
        drafter = Drafter(proposer, adaptive_drafts) if proposer is not None else None
        self.scheduler = Scheduler(self.config, self.kv, max_model_len, drafter)
        self.executor = FakeExecutor(block_size)
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finish_reasons: dict[str, FinishReason] = {}
        self.admitted: list[str] = []                 # request ids, in first-admission order
        self.preempted: list[list[str]] = []          # per step
        self.scheduled: list[SchedulerOutput] = []
        self.all_requests: dict[str, Request] = {}
        self.num_steps = 0

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.all_requests[request.request_id] = request
            self.scheduler.add_request(request)

    def victim_key(self, request: Request) -> tuple:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    def step(self) -> SchedulerOutput:
        sched, config = self.scheduler, self.config
        running_before = list(sched.running)
        decodes = [r for r in running_before if r.num_tokens - r.num_computed_tokens == 1]
        streaming = any(r.num_output_tokens for r in running_before)
        out = sched.schedule()
        self.num_steps += 1
        self.scheduled.append(out)
        self._check_drafts(out, decodes)
        # the checks below are of the tokens the request needs (its drafts apart)
        counts = {rid: n - len(out.draft_token_ids.get(rid, ()))
                  for rid, n in out.num_scheduled_tokens.items()}
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        budget, cap = config.max_num_batched_tokens, config.chunk_cap
        step_budget = budget
        head_cap = None   # under a smaller idle budget: one chunk (the head's) may reach it
        if not streaming and config.idle_batched_tokens not in (0, budget):
            # No stream decoding: the idle budget, larger or smaller. The head's prompt may
            # take the step past a smaller one (up to the cap), beside the last prompt tokens
            # scheduled before it; the prompts joining it may not.
            idle = step_budget = config.idle_batched_tokens
            cap = min(config.max_prefill_chunk or idle, idle)
            budget = idle
            if idle < config.max_num_batched_tokens:
                head_cap = config.chunk_cap
                last_tokens = sum(1 for r in decodes if counts.get(r.request_id) == 1)
                budget = max(idle, last_tokens + max(counts.values(), default=0))
        whole_from = config.unchunked_prefill_min or budget + 1
        if out.total_num_scheduled_tokens > budget:
            # only a whole long prompt may pass the budget, and it ends the step
            last = list(counts.values())[-1]
            assert last >= whole_from and not out.draft_token_ids
            assert out.total_num_scheduled_tokens - last < budget
        assert len(counts) <= config.max_num_seqs and len(sched.running) <= config.max_num_seqs
        assert set(counts) <= {r.request_id for r in sched.running}
        past_cap = [n for n in counts.values() if not (1 <= n <= cap or n >= whole_from)]
        assert not past_cap or (head_cap is not None and len(past_cap) == 1
                                and past_cap[0] <= head_cap)
        for data in out.new_requests:
            if data.request_id not in self.admitted:
                self.admitted.append(data.request_id)
        preempted = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        assert out.num_preemptions == len(preempted)
        assert {r.request_id for r in preempted} <= out.finished_request_ids
        if preempted:      # the lowest-priority, latest-arrived runners; ties: latest admitted
            ranked = sorted(reversed(running_before), key=self.victim_key, reverse=True)
            assert {r.request_id for r in ranked[:len(preempted)]} == \
                {r.request_id for r in preempted}
        elif len(decodes) <= step_budget:
            for request in decodes:    # a decode is never starved by prompt chunks
                assert counts.get(request.request_id) == 1, request.request_id
        self.preempted.append([r.request_id for r in preempted])
        result = self.executor.execute(out)
        for output in sched.update(out, result):
            assert output.request_id not in self.finish_reasons
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                self.finish_reasons[output.request_id] = output.finish_reason
        self.kv.check_integrity()
        return out

    def _check_drafts(self, out: SchedulerOutput, decodes: list[Request]) -> None:
        """Drafts only for decoding requests, only in steps without prompt work, never past
        max_tokens or max_model_len."""
        if not out.draft_token_ids:
            return
        assert set(out.draft_token_ids) <= {r.request_id for r in decodes}
        assert all(n == 1 + len(out.draft_token_ids.get(rid, ()))
                   for rid, n in out.num_scheduled_tokens.items())
        for rid, drafts in out.draft_token_ids.items():
            request = self.scheduler.requests[rid]
            assert 1 <= len(drafts) <= request.max_tokens - request.num_output_tokens - 1
            assert request.num_tokens + len(drafts) < self.scheduler.max_model_len

    def run(self, max_steps: int = 1000) -> None:
        while self.scheduler.has_unfinished:
            assert self.num_steps < max_steps, "requests did not finish in time"
            self.step()

    def check_end(self) -> None:
        """Nothing left: every block free after evict_all, the worker forgot everyone."""
        assert not self.scheduler.has_unfinished and not self.scheduler.requests
        self.step()                                   # delivers the last finished ids
        assert self.executor.states == {}
        self.kv.check_integrity()
        self.kv.evict_all()
        self.kv.check_integrity()
        assert self.kv.pool.num_free == self.kv.num_blocks

    def check_outputs(self, eos: dict[str, int] | None = None) -> None:
        for rid, request in self.all_requests.items():
            if self.finish_reasons.get(rid) == FinishReason.ABORT:
                continue
            want = expected_output(request.prompt_token_ids, request.max_tokens,
                                   (eos or {}).get(rid))
            assert self.outputs[rid] == want, rid
            assert request.output_token_ids == want
            assert self.finish_reasons[rid] == (
                FinishReason.LENGTH if len(want) == request.max_tokens else FinishReason.STOP)
