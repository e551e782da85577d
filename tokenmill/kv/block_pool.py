"""BlockPool: fixed-size KV blocks, a free list and per-block request ref counts.

It knows nothing about tokens or the prefix tree: the KV manager decides whether a block whose
ref count drops to zero goes back to the free list or stays cached in the tree.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def take(self, num: int) -> list[int]:
        """Hand out `num` free blocks with ref count 1."""
        assert num <= len(self._free), f"asked for {num} blocks, {len(self._free)} free"
        blocks = [self._free.popleft() for _ in range(num)]
        for block in blocks:
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for block in blocks:
            self.ref_counts[block] += 1

    def decref(self, blocks: list[int]) -> list[int]:
        """Drop one reference from each block; returns those no request holds any more."""
        unused = []
        for block in blocks:
            assert self.ref_counts[block] > 0, f"block {block} released twice"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                unused.append(block)
        return unused

    def put_back(self, blocks: list[int]) -> None:
        """Return unreferenced, uncached blocks to the free list."""
        for block in blocks:
            assert self.ref_counts[block] == 0, f"block {block} still referenced"
        self._free.extend(blocks)
