"""Sampler: logits of the rows that pick a token -> token ids (+ logprobs).

Order: logit bias and min-token masking, penalties, then greedy argmax or temperature /
top-k / top-p / min-p sampling. Randomness for token i of a request comes from a generator
seeded with (request seed, i) alone, so a request draws the same tokens whatever else is in
the batch and after a preemption. Logprobs are those of the model's raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.outputs import TokenLogprobs
from tokenmill.sample.logprobs import token_logprobs
from tokenmill.sample.penalties import apply_penalties
from tokenmill.sampling_params import SamplingParams

_MASK = float("-inf")


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    output_index: int                 # how many tokens the request has produced before this one
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]


def _noise_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % (2 ** 63 - 1)


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias) or p.uses_penalties or row.output_index < p.min_tokens


def sample(logits: torch.Tensor, rows: list[SamplingRow]
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [len(rows), vocab] float32. Returns the chosen ids and per-row logprobs."""
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
    if any(_needs_processing(r) for r in rows):
        logits = _process(logits.clone(), rows)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        chosen[index] = _sample_random(logits[index], [rows[i] for i in random_rows])
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        picked = [i for i, want in enumerate(want_logprobs) if want]
        index = torch.tensor(picked, device=logits.device)
        computed = token_logprobs(raw_logprobs[index], chosen[index],
                                  [rows[i].params.logprobs for i in picked])
        for i, value in zip(picked, computed):
            result[i] = value
    return chosen.tolist(), result


def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if row.output_index < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
            if banned:
                logits[i, torch.tensor(sorted(banned), device=logits.device)] = _MASK
    penalized = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if penalized:
        index = torch.tensor(penalized, device=logits.device)
        logits[index] = apply_penalties(logits[index], [rows[i] for i in penalized])
    return logits


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] ids drawn by the exponential race (Gumbel-max)."""
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < logits.shape[1] for k in top_k) or any(p < 1 for p in top_p):
        logits = _top_k_top_p(logits, torch.tensor(top_k, device=device),
                              torch.tensor(top_p, device=device))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows], device=device).unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        generator = torch.Generator(device=device).manual_seed(
            _noise_seed(row.seed, row.output_index))
        noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but the k best tokens, then all beyond the smallest set with mass >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _MASK)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), _MASK)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
