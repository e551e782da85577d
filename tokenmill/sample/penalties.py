"""Repetition, presence and frequency penalties."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.sampling_params import SamplingParams


class _Row(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def apply_penalties(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
    """logits: [rows, vocab] -> penalized copy.

    Repetition (Keskar et al.) divides positive / multiplies negative logits of every token
    seen in the prompt or output; presence and frequency (OpenAI) subtract for tokens in the
    output, once and per occurrence.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(num_rows, vocab, device=device)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if row.output_token_ids:
            ids = torch.tensor(row.output_token_ids, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
            seen[i, ids] = True
        if row.params.repetition_penalty != 1 and row.prompt_token_ids:
            seen[i, torch.tensor(row.prompt_token_ids, device=device)] = True
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).float()
