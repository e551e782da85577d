"""Waiting queues: requests in the order the scheduler should admit them.

FCFS (and LPM, which the scheduler reorders by cached prefix) orders by arrival; the priority
policy by (priority, arrival), lower priority values first. A preempted request keeps its
arrival time, so it goes back ahead of later arrivals. Ties (n > 1 siblings arrive together)
keep insertion order.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Iterator

from tokenmill.request import Request


class WaitingQueue:
    def __init__(self, policy: str) -> None:
        assert policy in ("fcfs", "priority", "lpm")
        self.policy = policy
        self._items: list[tuple[tuple, Request]] = []
        self._seq = itertools.count()
        self._keys: dict[str, tuple] = {}

    def _key(self, request: Request) -> tuple:
        priority = request.priority if self.policy == "priority" else 0
        return (priority, request.arrival_time, next(self._seq))

    def add(self, request: Request) -> None:
        key = self._keys.get(request.request_id) or self._key(request)
        self._keys[request.request_id] = key
        bisect.insort(self._items, (key, request), key=lambda item: item[0])

    def remove(self, request: Request) -> bool:
        key = self._keys.pop(request.request_id, None)
        if key is None:
            return False
        index = bisect.bisect_left(self._items, key, key=lambda item: item[0])
        assert self._items[index][1] is request
        del self._items[index]
        return True

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._keys

    def __iter__(self) -> Iterator[Request]:
        return iter([request for _, request in self._items])

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
