"""Which proposed drafts a decode step checks, and what came of them.

A draft is one more row in a decode step. A step of d decoding rows costs about F + d rows'
worth (F, the fixed part: the weights streamed and rebuilt, ~5 rows for SmolLM2 on a 2-core
CPU, far more on a GPU; the engine times it at start-up, engine/calibration.py), so it
yields d tokens for F + d. A draft yields a token only if it and the drafts before
it are all kept. The adaptive policy estimates for each request the chance that a draft is
kept when the one before it was (its own recent record, shrunk toward the record of all
requests), gives the j-th draft the chance p^j, and adds drafts to the step in order of that
chance while each one's chance beats the tokens per row the step already yields: every draft
taken raises the step's expected tokens per unit of cost. So one stream drafts freely, a busy
batch only where drafts are nearly always right. A request whose drafts are all left out
still learns: its first draft is compared with the token the step then samples.

The `all` policy checks every proposed draft. Pure Python, run by the scheduler.
"""

from __future__ import annotations

from typing import Protocol

FIXED_COST_ROWS = 5.0    # a decode step's fixed cost in rows' worth, until measured
_PRIOR = 0.7             # the chance of a kept draft before anything is known
_PRIOR_WEIGHT = 2.0      # trials' worth of that prior in the overall record, and of the
                         # overall record in a request's own
_REQUEST_DECAY = 0.8     # a request's record follows its latest drafts
_OVERALL_DECAY = 0.99    # the overall record follows the workload


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]: ...
    def forget(self, request_id: str) -> None: ...


class _Record:
    """Decayed counts of drafts kept and of drafts that had a chance (the ones after a
    rejection are never looked at)."""

    def __init__(self, kept: float = 0.0, trials: float = 0.0) -> None:
        self.kept, self.trials = kept, trials

    def add(self, kept: int, trials: int, decay: float) -> None:
        self.kept = self.kept * decay + kept
        self.trials = self.trials * decay + trials


class Drafter:
    """The scheduler's side of speculative decoding: proposals, the choice, the record."""

    def __init__(self, proposer: Proposer, adaptive: bool = True,
                 fixed_cost_rows: float = FIXED_COST_ROWS) -> None:
        self.proposer = proposer
        self.adaptive = adaptive
        self.fixed_cost_rows = fixed_cost_rows
        self.num_draft_tokens = 0       # drafts checked, total
        self.num_accepted_tokens = 0    # of those, kept
        self._overall = _Record(_PRIOR * _PRIOR_WEIGHT, _PRIOR_WEIGHT)
        self._records: dict[str, _Record] = {}
        self._guesses: dict[str, int] = {}   # first drafts left out of this step

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return self.proposer.propose(request_id, token_ids, max_tokens)

    def keep_chance(self, request_id: str) -> float:
        """The chance that the request's next draft is kept if the one before it was."""
        overall = self._overall.kept / self._overall.trials
        own = self._records.get(request_id) or _Record()
        return (own.kept + _PRIOR_WEIGHT * overall) / (own.trials + _PRIOR_WEIGHT)

    def choose(self, proposals: dict[str, list[int]], num_decodes: int,
               budget: int) -> dict[str, list[int]]:
        """The drafts to check in a step of `num_decodes` decoding requests: a prefix of each
        request's proposal, at most `budget` in all."""
        self._guesses = {}
        if not self.adaptive:
            chosen = {}
            for request_id, drafts in proposals.items():
                if budget <= 0:
                    break
                chosen[request_id] = drafts[:budget]
                budget -= len(chosen[request_id])
            return chosen
        counts = self._counts(proposals, num_decodes, budget)
        for request_id, drafts in proposals.items():
            if request_id not in counts:
                self._guesses[request_id] = drafts[0]
        return {rid: proposals[rid][:count] for rid, count in counts.items()}

    def _counts(self, proposals: dict[str, list[int]], num_decodes: int,
                budget: int) -> dict[str, int]:
        chances = {rid: self.keep_chance(rid) for rid in proposals}
        # (chance, position): a request's drafts come in order, as p^j falls with j
        rows = sorted(((chances[rid] ** j, j, rid) for rid, drafts in proposals.items()
                       for j in range(1, len(drafts) + 1)), key=lambda row: (-row[0], row[1]))
        tokens, cost = float(num_decodes), self.fixed_cost_rows + num_decodes
        counts: dict[str, int] = {}
        for chance, position, request_id in rows[:max(budget, 0)]:
            if chance * cost <= tokens:
                break
            tokens, cost = tokens + chance, cost + 1
            counts[request_id] = position
        return counts

    def record(self, request_id: str, num_drafts: int, sampled: list[int]) -> None:
        """After a step: `num_drafts` of the request's drafts were checked (maybe none) and
        `sampled` is what the step gave it (the kept drafts, then the token after them)."""
        guess = self._guesses.pop(request_id, None)
        if num_drafts:
            kept = len(sampled) - 1
            assert 0 <= kept <= num_drafts, (request_id, kept, num_drafts)
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += kept
            trials = min(kept + 1, num_drafts)
        elif guess is not None and sampled:
            kept, trials = int(sampled[0] == guess), 1
        else:
            return
        self._records.setdefault(request_id, _Record()).add(kept, trials, _REQUEST_DECAY)
        self._overall.add(kept, trials, _OVERALL_DECAY)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self._records.pop(request_id, None)
        self._guesses.pop(request_id, None)
