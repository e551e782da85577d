"""The sampler on synthetic logits, where the right answers are known."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from tokenmill.sample.penalties import apply_penalties
from tokenmill.sample import sampler
from tokenmill.sample.sampler import (_CANDIDATE_COUNTS, SamplingRow, _candidate_probs,
                                      _top_k_top_p, sample)
from tokenmill.sampling_params import SamplingParams


def row(params: SamplingParams, index: int = 0, seed: int = 0, prompt=(), output=()):
    return SamplingRow(params, seed, index, list(prompt), list(output), frozenset({0}))


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    ids, _ = sample(logits, [row(SamplingParams(temperature=0))] * 2)
    assert ids == [1, 0]


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(0, 5),
       vocab=st.sampled_from([3, 64, 100, 256, 512, 1000, 4096, 8192, 12_291, 49_152]),
       levels=st.integers(1, 6), nan_at=st.lists(st.integers(0, 10**6), max_size=3),
       top=st.one_of(st.none(), st.sampled_from([float("inf"), float("-inf")])),
       seed=st.integers(0, 2**16), pick=st.sampled_from(["greedy_ids", "chunked_argmax"]))
def test_greedy_ids_is_argmax_with_ties_and_nan(rows, vocab, levels, nan_at, top, seed, pick):
    # few distinct values make ties common (across the kernel's per-thread pieces of a row,
    # from 8,192 logits, too); argmax's answer is the first of them, or the first NaN
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    if top is not None and rows:
        logits[:, vocab // 2:] = top
    for at in nan_at if rows else ():
        logits.view(-1)[at % logits.numel()] = float("nan")
    assert torch.equal(getattr(sampler, pick)(logits), logits.argmax(dim=-1))


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    params = SamplingParams(temperature=1.0, seed=3)
    draws = [sample(logits, [row(params, index=i, seed=3)])[0][0] for i in range(4000)]
    assert_frequencies(draws, probs)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    cases = [(dict(top_k=2), {0, 1}), (dict(top_p=0.7), {0, 1}), (dict(min_p=0.3), {0, 1})]
    for kwargs, support in cases:
        params = SamplingParams(temperature=1.0, **kwargs)
        seen = {sample(logits, [row(params, index=i, seed=i)])[0][0] for i in range(300)}
        assert seen == support, kwargs


def assert_frequencies(draws: list[int], probs: torch.Tensor) -> None:
    for token, p in enumerate(probs.tolist()):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws)) + 1e-9, (token, freq, p)


def test_sampling_follows_the_truncated_distribution():
    # 200 tokens: the best 64 hold the nucleus, so the draw takes the candidate path
    probs = torch.cat([torch.tensor([0.3, 0.25, 0.2, 0.1, 0.05]), torch.full((195,), 0.1 / 195)])
    logits = probs.log().unsqueeze(0)
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=5)
    draws = [sample(logits, [row(params, index=i, seed=5)])[0][0] for i in range(4000)]
    nucleus = torch.zeros(200)
    nucleus[:4] = probs[:4] / probs[:4].sum()   # mass before the 5th token is 0.85 >= 0.8
    assert_frequencies(draws, nucleus)


@pytest.mark.parametrize("draw, expected", [(0.0, 1), (1.0 - 2.0 ** -53, 3)])
def test_extreme_draws_never_pick_a_masked_token(monkeypatch, draw, expected):
    monkeypatch.setattr(sampler, "_uniform", lambda seed, index: draw)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    assert sampler._draw(probs, None, [row(SamplingParams(temperature=1.0))]).tolist() == [expected]


def test_nucleus_beyond_the_candidates_is_sorted_in_full():
    # nearly flat over 3,000 tokens: top_p = 0.5 keeps about 1,500, more than any candidate set
    logits = -torch.arange(3000.0).unsqueeze(0) * 1e-4
    params = SamplingParams(temperature=1.0, top_p=0.5)
    draws = {sample(logits, [row(params, index=i, seed=i)])[0][0] for i in range(300)}
    support = _top_k_top_p(logits, torch.tensor([3000]), torch.tensor([0.5]))[0] > float("-inf")
    assert all(support[token] for token in draws)
    assert max(draws) >= max(_CANDIDATE_COUNTS)   # reached past the largest candidate set


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([100, 1500, 3000]), st.floats(0.2, 12.0), st.integers(0, 3000),
       st.floats(0.05, 1.0), st.integers(0, 2 ** 31))
@example(1500, 1.0, 64, 0.9, 0)   # top-k exactly a candidate count
def test_candidates_hold_the_reference_distribution(vocab, scale, top_k, top_p, seed):
    """Where a candidate set claims to cover a row, its probabilities are the full sort's."""
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    k = torch.tensor([top_k if 0 < top_k < vocab else vocab] * 2)
    p = torch.tensor([top_p] * 2)
    # A token whose preceding mass is within float32 cumsum error of top_p may fall on either
    # side of the cut in either path (both normalize in their own order): no answer is right.
    kept = torch.arange(vocab).unsqueeze(0) < k.unsqueeze(1)
    sorted_probs = logits.sort(dim=-1, descending=True).values.masked_fill(
        ~kept, float("-inf")).double().softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    assume(not ((before - top_p).abs() < 1e-5).any())
    reference = _top_k_top_p(logits, k, p).softmax(dim=-1)
    for count in (c for c in _CANDIDATE_COUNTS if c < vocab):
        probs, ids, covered = _candidate_probs(logits, k, p, count)
        for r in covered.nonzero().flatten().tolist():
            got = torch.zeros(vocab).scatter_(0, ids[r], probs[r] / probs[r].sum())
            torch.testing.assert_close(got, reference[r], atol=1e-6, rtol=1e-4)
        mass = logits.softmax(dim=-1).topk(count, dim=-1).values.sum(dim=-1)
        for r in range(2):   # covered: top-k inside the candidates; without top-k, enough mass
            if 0 < top_k < vocab:
                assert bool(covered[r]) == (top_k <= count)
            elif abs(mass[r] - top_p) > 1e-5:
                assert bool(covered[r]) == bool(mass[r] >= top_p)


def test_seeded_draw_depends_only_on_seed_and_index():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0)
    together, _ = sample(logits, [row(params, 7, 11), row(params, 2, 5), row(params, 1, 9)])
    alone, _ = sample(logits[1:2], [row(params, 2, 5)])
    assert together[1] == alone[0]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])   # eos is 0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [row(params, index=1)])[0] == [1]
    assert sample(logits, [row(params, index=2)])[0] == [0]


def test_min_tokens_with_ignore_eos_and_no_stop_tokens_masks_nothing():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])   # eos is 0
    params = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [row(params, index=0)])[0] == [0]
    with_stop = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[0])
    assert sample(logits, [row(with_stop, index=0)])[0] == [2]


def test_logprobs_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    _, lps = sample(logits, [row(SamplingParams(temperature=0, logprobs=2))])
    expected = logits.log_softmax(-1)[0]
    assert lps[0].token_ids == [1, 1, 2] and lps[0].ranks == [1, 1, 2]
    assert lps[0].logprobs[0] == pytest.approx(float(expected[1]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=6, max_size=6), st.lists(st.integers(0, 5), max_size=8),
       st.lists(st.integers(0, 5), max_size=4), st.floats(-2, 2), st.floats(-2, 2),
       st.floats(0.5, 2.0))
def test_penalties_match_their_definitions(values, output, prompt, freq, pres, rep):
    logits = torch.tensor([values])
    params = SamplingParams(frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep)
    got = apply_penalties(logits, [row(params, prompt=prompt, output=output)])[0]
    for token, value in enumerate(values):
        expected = value
        if token in output or token in prompt:
            expected = value / rep if value > 0 else value * rep
        count = output.count(token)
        expected -= freq * count + (pres if count else 0.0)
        assert float(got[token]) == pytest.approx(expected, abs=1e-5)
