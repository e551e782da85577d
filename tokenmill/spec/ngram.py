"""N-gram (prompt lookup) draft proposer: guess a request's next tokens by finding the latest
earlier place where its last few tokens occurred and copying what followed them there.

Pure Python over token lists, run by the scheduler. Each request keeps an index from every
n-gram of its history to the end of that n-gram's latest occurrence, grown by the tokens that
arrived since the last call, so a proposal costs O(new tokens x n sizes), not a scan of the
whole history.
"""

from __future__ import annotations


class _History:
    """One request's n-gram index: for each n, n-gram -> index of its last token."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0   # n-grams ending before this position are in `latest`

    def extend(self, token_ids: list[int]) -> None:
        """Index the n-grams ending before the last token: the last one is the query, and an
        occurrence must lie before it."""
        for end in range(self.indexed, len(token_ids) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.latest[n][tuple(token_ids[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, len(token_ids) - 1)

    def continuation(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix."""
        for n in reversed(self.sizes):
            if len(token_ids) <= n:
                continue
            end = self.latest[n].get(tuple(token_ids[-n:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + num_tokens]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n and num_speculative_tokens >= 1
        self.num_speculative_tokens = num_speculative_tokens
        self.sizes = range(min_n, max_n + 1)
        self._histories: dict[str, _History] = {}

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens to follow `token_ids`
        (the request's prompt and outputs so far); [] when no suffix occurred before."""
        limit = min(self.num_speculative_tokens, max_tokens)
        if limit <= 0:
            return []
        history = self._histories.get(request_id)
        if history is None or history.indexed > len(token_ids):
            history = self._histories[request_id] = _History(self.sizes)
        history.extend(token_ids)
        return history.continuation(token_ids, limit)

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
