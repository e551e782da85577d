"""The order in which the scheduler tries waiting requests, and which should wait a step.

LPM (longest prefix match): the waiting request with the most of its prompt in the prefix
cache goes first, so shared prefixes are computed once and reused while cached; a request
passed over by later arrivals `MAX_SKIPS` times goes first, so none starves; past
`MAX_QUEUE` waiting requests the order is the queue's own (sorting would cost more than it
saves). FCFS and priority take the queue's order as it is. Separately, a prompt whose next
uncached block a running request is computing right now waits for it to land in the cache.

Pure Python over requests and the KV manager's lookups.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from tokenmill.kv.manager import KVCacheManager
from tokenmill.request import Request

MAX_QUEUE = 128
MAX_SKIPS = 32


class AdmissionOrder:
    def __init__(self, policy: str, kv: KVCacheManager) -> None:
        self.policy = policy
        self.kv = kv
        self._skips: dict[str, int] = {}   # LPM: times later arrivals were admitted first

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        """The waiting requests in the order to try them."""
        queue = list(waiting)
        if self.policy != "lpm" or len(queue) > MAX_QUEUE or not self.kv.prefix_cache:
            return queue
        starving = [r for r in queue if self._skips.get(r.request_id, 0) >= MAX_SKIPS]
        rest = [r for r in queue if self._skips.get(r.request_id, 0) < MAX_SKIPS]
        rest.sort(key=lambda r: -self.kv.num_cached_tokens(r))   # stable: ties by arrival
        return starving + rest

    def admitted(self, request: Request, ahead: Iterable[Request],
                 waiting: Container[Request]) -> None:
        """`request` was admitted after trying `ahead`; those still `waiting` that arrived
        no later than it count a skip."""
        self._skips.pop(request.request_id, None)
        if self.policy != "lpm":
            return
        for other in ahead:
            if other.arrival_time <= request.arrival_time and other in waiting:
                self._skips[other.request_id] = self._skips.get(other.request_id, 0) + 1

    def forget(self, request_id: str) -> None:
        self._skips.pop(request_id, None)


def prefix_in_flight(kv: KVCacheManager, request: Request, running: Iterable[Request]) -> bool:
    """A running request is computing this prompt's next uncached block right now: better to
    wait a step or two for it to land in the cache than to compute it twice."""
    if not kv.prefix_cache:
        return False
    start = kv.num_cached_tokens(request)
    end = start + kv.block_size
    if end >= request.num_tokens:
        return False
    block = request.all_token_ids[start:end]
    return any(other.num_computed_tokens < end <= other.num_tokens
               and other.cache_salt == request.cache_salt
               and other.all_token_ids[start:end] == block
               and other.all_token_ids[:kv.block_size] == request.all_token_ids[:kv.block_size]
               for other in running)
