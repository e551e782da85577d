"""StepPlan: what one `Scheduler.schedule()` call has decided so far.

The token budget left, the tokens and new KV blocks of each scheduled request, the requests
admitted and preempted in this step, and the drafts each decode checks.
"""

from __future__ import annotations

from tokenmill.request import Request


class StepPlan:
    def __init__(self, budget: int, chunk_cap: int) -> None:
        self.budget = budget
        self.chunk_cap = chunk_cap
        self.head: Request | None = None   # under a smaller idle budget: its chunk is not cut
        self.head_cap = chunk_cap
        self.num_tokens: dict[str, int] = {}
        self.new_blocks: dict[str, list[int]] = {}
        self.new_requests: list[Request] = []
        self.preempted: list[Request] = []
        self.drafts: dict[str, list[int]] = {}

    def add(self, request: Request, num_tokens: int, blocks: list[int]) -> None:
        self.num_tokens[request.request_id] = num_tokens
        self.new_blocks[request.request_id] = blocks
        self.budget -= num_tokens

    def add_drafts(self, request: Request, drafts: list[int], blocks: list[int]) -> None:
        """A scheduled decode also checks `drafts` (with `blocks` for them)."""
        self.num_tokens[request.request_id] += len(drafts)
        self.new_blocks[request.request_id].extend(blocks)
        self.drafts[request.request_id] = drafts
        self.budget -= len(drafts)

    def drop(self, request: Request) -> None:
        num = self.num_tokens.pop(request.request_id, 0)
        self.new_blocks.pop(request.request_id, None)
        self.drafts.pop(request.request_id, None)
        self.budget += num

    @property
    def has_prompt_work(self) -> bool:
        """Some request computes more than one token: a prompt (or a chunk of one)."""
        return any(n > 1 for n in self.num_tokens.values())
