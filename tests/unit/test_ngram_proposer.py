"""The n-gram proposer against a direct scan of the history, as tokens arrive."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.spec.ngram import NgramProposer


def scan(token_ids: list[int], num: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix, by brute force."""
    for n in range(max_n, min_n - 1, -1):
        if len(token_ids) <= n:
            continue
        suffix = token_ids[-n:]
        for end in range(len(token_ids) - 2, n - 2, -1):
            if token_ids[end + 1 - n:end + 1] == suffix:
                return token_ids[end + 1:end + 1 + num]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60),   # few symbols: many repeats
       st.lists(st.integers(1, 6), min_size=1, max_size=20),   # tokens arriving per call
       st.integers(1, 4), st.integers(1, 3), st.integers(0, 3), st.integers(0, 6))
def test_proposals_match_a_scan_of_the_history(tokens, arrivals, num, min_n, extra_n, room):
    max_n = min_n + extra_n
    proposer = NgramProposer(num, min_n, max_n)
    seen = 1
    for arrived in arrivals:
        history = tokens[:seen]
        drafts = proposer.propose("r", history, room)
        assert drafts == scan(history, min(num, room), min_n, max_n)
        assert len(drafts) <= min(num, room)
        seen = min(len(tokens), seen + arrived)


def test_requests_keep_separate_histories_and_forget_resets():
    proposer = NgramProposer(3, 1, 2)
    assert proposer.propose("a", [5, 6, 7, 5], 10) == [6, 7, 5]
    assert proposer.propose("b", [1, 2, 3], 10) == []
    assert proposer.propose("a", [5, 6, 7, 5, 6], 10) == [7, 5, 6]
    proposer.forget("a")
    assert proposer.propose("a", [9, 9], 10) == [9]
    assert proposer.propose("a", [9, 9], 0) == []
