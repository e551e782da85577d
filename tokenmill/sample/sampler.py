"""Sampler: logits of the rows that pick a token -> token ids (+ logprobs).

Order: logit bias and min-token masking, penalties, then greedy argmax or temperature /
top-k / top-p / min-p sampling, by inverting the CDF at one uniform draw. The draw for token i
of a request depends on (request seed, i) alone, so a request draws the same tokens whatever
else is in the batch and after a preemption. Logprobs are those of the model's raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.cpu_fused import load_kernel as load_fused_kernel
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


def _mix_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % (2 ** 63 - 1)


def _min_tokens_banned(row: SamplingRow) -> set[int]:
    """The ids masked while the request is short of min_tokens: its stop tokens, and EOS
    unless it ignores EOS (then, with no stop tokens, nothing: the step's logits are left
    as they are, not copied)."""
    p = row.params
    if row.output_index >= p.min_tokens:
        return set()
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))


def _needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias) or p.uses_penalties or bool(_min_tokens_banned(row))


def sample(logits: torch.Tensor, rows: list[SamplingRow]
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [len(rows), vocab] float32. Returns the chosen ids and per-row logprobs."""
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
    if any(_needs_processing(r) for r in rows):
        logits = _process(logits.clone(), rows)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
    if not random_rows:
        chosen = greedy_ids(logits)
    elif not greedy_rows:
        chosen = _sample_random(logits, rows)
    else:
        chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        chosen[greedy_rows] = greedy_ids(logits[greedy_rows])
        chosen[random_rows] = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        picked = [i for i, want in enumerate(want_logprobs) if want]
        index = torch.tensor(picked, device=logits.device)
        computed = token_logprobs(raw_logprobs[index], chosen[index],
                                  [rows[i].params.logprobs for i in picked])
        for i, value in zip(picked, computed):
            result[i] = value
    return chosen.tolist(), result


# On CPU in fp32 the cpu_fused kernel picks in one scan (layers/cpu_fused_kernel.cpp). Else:
# torch's CPU argmax walks a row one element at a time (about 57 us for SmolLM2's 49,152
# logits), while amax is vectorized: the best chunk's max, then the argmax inside that chunk,
# cut 16 rows from 0.96 to 0.17 ms. Same answer as argmax, ties and NaN included: the first
# chunk holding the max (NaN counts as the max, as amax propagates it), then its first hit.
_ARGMAX_CHUNKS = (128, 64, 32, 16)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] int64, exactly logits.argmax(dim=-1)."""
    rows, vocab = logits.shape
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and rows and vocab:
        kernel = load_fused_kernel()
        if kernel is not None:
            return kernel.argmax_rows(logits.contiguous())
    return chunked_argmax(logits)


def chunked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """greedy_ids in torch ops (any device or dtype)."""
    rows, vocab = logits.shape
    chunk = next((c for c in _ARGMAX_CHUNKS if vocab % c == 0 and vocab >= 4 * c), None)
    if chunk is None or rows == 0:
        return logits.argmax(dim=-1)
    chunks = logits.contiguous().view(rows, vocab // chunk, chunk)
    best = chunks.amax(dim=-1).argmax(dim=-1)
    inside = chunks[torch.arange(rows, device=logits.device), best].argmax(dim=-1)
    return best * chunk + inside


def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        banned = _min_tokens_banned(row)
        if banned:
            logits[i, torch.tensor(sorted(banned), device=logits.device)] = _MASK
    penalized = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if penalized:
        index = torch.tensor(penalized, device=logits.device)
        logits[index] = apply_penalties(logits[index], [rows[i] for i in penalized])
    return logits


# Truncated rows (top-k / top-p) draw from their best 64, else 1,024, tokens when those hold
# the whole truncated set; a top-k pass finds them at a fraction of a full sort's cost (16 rows
# of SmolLM2's vocabulary: 0.7 and 4.4 ms against 32 ms). Rows they do not cover are sorted.
_CANDIDATE_COUNTS = (64, 1024)
_MASK64 = 2 ** 64 - 1


def _uniform(seed: int, index: int) -> float:
    """A draw in [0, 1) that depends on (seed, token index) alone (splitmix64's finalizer)."""
    z = (_mix_seed(seed, index) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] ids, each drawn by inverting the CDF of its (truncated)
    distribution at one uniform draw. Filling the vocabulary with exponential noise from a
    generator per row cost 1.8 ms a row, as much as a decode step's attention."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    logits = logits / temps
    top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab
                          for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    truncated = ((top_k < vocab) | (top_p < 1)).tolist()
    left = [i for i, t in enumerate(truncated) if t]
    full = [i for i, t in enumerate(truncated) if not t]
    if not left:
        return _draw(logits.softmax(dim=-1), None, rows)
    chosen = torch.empty(len(rows), dtype=torch.long, device=device)
    if full:
        chosen[full] = _draw(logits[full].softmax(dim=-1), None, [rows[i] for i in full])
    for count in _CANDIDATE_COUNTS:
        if not left or count >= vocab:
            break
        probs, ids, covered = _candidate_probs(logits[left], top_k[left], top_p[left], count)
        inside = covered.nonzero().flatten().tolist()
        if inside:
            chosen[[left[i] for i in inside]] = _draw(probs[inside], ids[inside],
                                                      [rows[left[i]] for i in inside])
        left = [row for row, done in zip(left, covered.tolist()) if not done]
    if left:
        masked = _top_k_top_p(logits[left], top_k[left], top_p[left])
        chosen[left] = _draw(masked.softmax(dim=-1), None, [rows[i] for i in left])
    return chosen


def _candidate_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, count: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The truncated distribution over each row's best `count` tokens, best first: (probs,
    ids, covered). A row is covered when they hold its whole truncated set: top-k within
    them, or, without top-k, at least top_p of the vocabulary's mass."""
    values, ids = logits.topk(count, dim=-1)
    ranks = torch.arange(count, device=logits.device).unsqueeze(0)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), _MASK)
    within = top_k <= count
    # normalized over the top-k set, or over the vocabulary when top-k is off
    norm = torch.where(within, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - norm.unsqueeze(1)).exp()
    mass = probs.sum(dim=-1)
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1), 0.0)
    covered = within | ((top_k == logits.shape[1]) & (mass >= top_p))
    return probs, ids, covered


def _draw(probs: torch.Tensor, ids: torch.Tensor | None, rows: list[SamplingRow]
          ) -> torch.Tensor:
    """probs: [rows, n] unnormalized (min-p is applied here) -> the drawn ids: ids[row,
    position], or the position itself when ids is None."""
    device = probs.device
    min_p = torch.tensor([r.params.min_p for r in rows], device=device).unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    draws = torch.tensor([[_uniform(r.seed, r.output_index)] for r in rows], device=device,
                         dtype=torch.float64)
    # u < 1 keeps u * total below the total (even rounded), so the first position whose CDF
    # exceeds it exists and has mass
    position = torch.searchsorted(cdf, draws * total, right=True).flatten()
    return position if ids is None else ids.gather(1, position.unsqueeze(1)).flatten()


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but the k best tokens, then all beyond the smallest set with mass >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _MASK)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), _MASK)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
