"""Turn one SchedulerOutput into the flattened input tensors of a forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import AttentionMetadata, PrefillSpan
from tokenmill.worker.request_state import RequestState


@dataclass
class PromptLogprobRows:
    request_id: str
    rows: slice                     # rows of the flattened batch
    target_ids: list[int]           # the next prompt token at each row


@dataclass
class StepBatch:
    request_ids: list[str]          # in batch order: decodes first, then prefill chunks
    input_ids: torch.Tensor         # [num_tokens]
    positions: torch.Tensor         # [num_tokens]
    attn: AttentionMetadata
    sample_rows: list[int]          # rows that pick a token this step, request by request
    sample_request_ids: list[str]
    sample_counts: list[int]        # rows per sampling request: 1 + its draft tokens
    prompt_logprob_rows: list[PromptLogprobRows]


def build_batch(states: list[RequestState], num_new: list[int], num_drafts: list[int],
                block_size: int, sliding_window: int | None, device: torch.device) -> StepBatch:
    """states/num_new: the scheduled requests (any order) and their new-token counts;
    num_drafts: how many of those are draft tokens (at the end of the request's token_ids).

    A decode with drafts is one decode row per token: row j attends to the context up to
    itself, which holds the keys and values the rows before it write in the same layer."""
    decoding = [num_new[i] == 1 + num_drafts[i] for i in range(len(states))]
    order = sorted(range(len(states)), key=lambda i: not decoding[i])  # decodes first
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_tables, decode_lens, prefills = [], [], []
    sample_rows, sample_ids, sample_counts, logprob_rows = [], [], [], []
    for i in order:
        state, n = states[i], num_new[i]
        start, row = state.num_computed_tokens, len(input_ids)
        input_ids.extend(state.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        blocks = state.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size
                     for p in range(start, start + n))
        seq_len = start + n
        needed = -(-seq_len // block_size)
        if decoding[i]:
            for length in range(start + 1, seq_len + 1):
                decode_tables.append(blocks[:-(-length // block_size)])
                decode_lens.append(length)
        else:
            prefills.append(PrefillSpan(row, n, seq_len,
                                        torch.tensor(blocks[:needed], device=device)))
        if seq_len == len(state.token_ids):
            count = 1 + num_drafts[i]
            sample_rows.extend(range(row + n - count, row + n))
            sample_ids.append(state.request_id)
            sample_counts.append(count)
        if state.params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
            end = min(seq_len, state.num_prompt_tokens - 1)
            logprob_rows.append(PromptLogprobRows(
                state.request_id, slice(row, row + end - start),
                state.token_ids[start + 1:end + 1]))
    width = max((len(t) for t in decode_tables), default=1)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]
    decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(decode_tables),
        decode_block_table=torch.tensor(padded, dtype=torch.long, device=device).view(-1, width),
        decode_seq_lens=decode_seq_lens,
        prefills=prefills, sliding_window=sliding_window)
    return StepBatch([states[i].request_id for i in order],
                     torch.tensor(input_ids, dtype=torch.long, device=device),
                     torch.tensor(positions, dtype=torch.long, device=device),
                     attn, sample_rows, sample_ids, sample_counts, logprob_rows)
