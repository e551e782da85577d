"""ModelRunner: keeps per-request state and the KV cache, runs one forward per step, samples."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import ForwardContext
from tokenmill.kernels.huge_pages import huge_page_empty
from tokenmill.models.spec import ModelSpec
from tokenmill.outputs import RunnerOutput, SchedulerOutput, TokenLogprobs
from tokenmill.sample.logprobs import token_logprobs
from tokenmill.sample.sampler import SamplingRow, sample
from tokenmill.sample.speculative import kept_tokens
from tokenmill.worker.batch import StepBatch, build_batch
from tokenmill.worker.request_state import RequestState


class ModelRunner:
    def __init__(self, model: nn.Module, spec: ModelSpec, block_size: int,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [(self._zeros(shape), self._zeros(shape))
                          for _ in range(self.spec.num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":   # decode attention reads scattered blocks: huge pages
            return huge_page_empty(shape, self.dtype).zero_()   # zeroed now, not on first use
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        self._update_states(scheduled)
        if scheduled.is_empty:
            return RunnerOutput([], [])
        request_ids = list(scheduled.num_scheduled_tokens)
        states = [self.requests[rid] for rid in request_ids]
        num_new = [scheduled.num_scheduled_tokens[rid] for rid in request_ids]
        drafts = scheduled.draft_token_ids
        for rid, state in zip(request_ids, states):   # checked as if already sampled
            state.token_ids.extend(drafts.get(rid, ()))
        batch = build_batch(states, num_new, [len(drafts.get(r, ())) for r in request_ids],
                            self.block_size, self.spec.sliding_window, self.device)
        hidden = self.model(batch.input_ids, batch.positions,
                            ForwardContext(batch.attn, self.kv_caches))  # [num_tokens, hidden]
        for state, n in zip(states, num_new):
            state.num_computed_tokens += n
        sampled, logprobs = self._sample(hidden, batch, drafts)
        return RunnerOutput(
            req_ids=batch.request_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in batch.request_ids],
            logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(hidden, batch))

    def _update_states(self, scheduled: SchedulerOutput) -> None:
        for rid in scheduled.finished_request_ids:
            self.requests.pop(rid, None)
        for data in scheduled.new_requests:
            self.requests[data.request_id] = RequestState.from_new(data)
        for data in scheduled.cached_requests:
            state = self.requests[data.request_id]
            state.block_ids.extend(data.new_block_ids)
            assert state.num_computed_tokens == data.num_computed_tokens, data.request_id

    def _sample(self, hidden: torch.Tensor, batch: StepBatch, drafts: dict[str, list[int]]
                ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        if not batch.sample_rows:
            return {}, {}
        logits = self.model.compute_logits(self._rows(hidden, batch.sample_rows))  # [rows, vocab]
        states = [self.requests[rid] for rid in batch.sample_request_ids]
        rows = [row for s, count in zip(states, batch.sample_counts)
                for row in self._sampling_rows(s, count)]
        token_ids, logprobs = sample(logits, rows)
        sampled, chosen, first = {}, {}, 0
        for state, count in zip(states, batch.sample_counts):
            rid, end = state.request_id, first + count
            kept = self._keep(state, token_ids[first:end], drafts.get(rid, []))
            sampled[rid] = kept
            if logprobs[first] is not None:
                chosen[rid] = logprobs[first:first + len(kept)]
            first = end
        return sampled, chosen

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """hidden's `rows`: in a decode-only step every row, in order, as it is (indexing a
        copy out cost 30-40 us a step)."""
        if len(rows) == hidden.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1:
            return hidden   # ascending, distinct, so exactly 0 .. n - 1
        return hidden.index_select(0, torch.tensor(rows, device=self.device))

    def _sampling_rows(self, state: RequestState, count: int) -> list[SamplingRow]:
        """One row per position sampled: the request's next token, then one after each of
        its count - 1 drafts (the last tokens of state.token_ids)."""
        base = len(state.token_ids) - (count - 1)     # tokens before the drafts
        prompt = state.prompt_token_ids
        return [SamplingRow(state.params, state.seed, base + j - state.num_prompt_tokens,
                            prompt, state.token_ids[state.num_prompt_tokens:base + j],
                            self.eos_token_ids)
                for j in range(count)]

    @staticmethod
    def _keep(state: RequestState, sampled: list[int], drafts: list[int]) -> list[int]:
        """Replace the drafts in state.token_ids by what the step keeps, and take the
        rejected drafts' positions back from num_computed_tokens."""
        kept = kept_tokens(sampled, drafts)
        if drafts:
            del state.token_ids[-len(drafts):]
            state.num_computed_tokens -= len(drafts) - (len(kept) - 1)
        state.token_ids.extend(kept)
        return kept

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch
                         ) -> dict[str, list[TokenLogprobs]]:
        result = {}
        for entry in batch.prompt_logprob_rows:
            logits = self.model.compute_logits(hidden[entry.rows])
            targets = torch.tensor(entry.target_ids, device=self.device)
            num_top = self.requests[entry.request_id].params.prompt_logprobs
            result[entry.request_id] = token_logprobs(logits.log_softmax(dim=-1), targets,
                                                      [num_top] * len(entry.target_ids))
        return result
