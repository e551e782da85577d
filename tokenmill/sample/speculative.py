"""Checking draft tokens (speculative decoding) without changing what is sampled.

Each checked position is sampled as it would have been without drafts: the same seed draw
(token index), min-token mask and penalties (the outputs before it, drafts included, which
is what it would have seen had they been sampled). A draft is kept when it equals the token
sampled at its position, which happens with exactly the probability the target distribution
gives it, so the output distribution (and, for a given seed, the output) is unchanged. For a
draft proposed deterministically (n-gram lookup) this accepts as often as rejection sampling.
"""

from __future__ import annotations


def kept_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """sampled: the tokens sampled after the last token and after each draft (len(drafts) +
    1); returns the drafts up to the first that differs from its sampled token, then the
    token sampled there (or after the last draft when all match)."""
    assert len(sampled) == len(drafts) + 1, (len(sampled), len(drafts))
    num_kept = 0
    while num_kept < len(drafts) and sampled[num_kept] == drafts[num_kept]:
        num_kept += 1
    return sampled[:num_kept + 1]
