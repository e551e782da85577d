"""KVCacheManager: the only owner of block ref counts, request block tables and tree locks.

A block is in exactly one of these states: free (in the pool's free list), used by requests
(ref count > 0), cached in the radix tree (kept after its requests end, evictable once no
request locks it), or used and cached at once. Eviction happens only when an allocation needs
more blocks than are free, and only takes unlocked tree leaves, so a block a running request
reads is never reused.

Prefix hits are token-exact, not only block-exact: a request that ends (or is preempted) with
a partly filled last block leaves that block in the tree as a tail, and the next request
whose prompt continues those tokens (the next turn of a chat, the request itself resumed)
takes the block over and computes only from where the tail's tokens end.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.radix_tree import Namespace, Node, RadixTree
from tokenmill.request import Request


@dataclass
class PrefixMatch:
    block_ids: list[int]       # whole blocks, shared
    node: Node | None          # tree node to lock; None for a sibling share or no hit
    tail: Node | None = None   # a tail to take over after the whole blocks
    tail_tokens: int = 0       # of the tail's tokens, those the request continues

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size + self.tail_tokens


NO_MATCH = PrefixMatch([], None)


@dataclass
class PrefixCacheStats:
    queries: int = 0           # prompt tokens looked up
    hits: int = 0              # of those, served from the cache
    evicted_blocks: int = 0

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def namespace_of(request: Request) -> Namespace:
    return (request.cache_salt,)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.pool = BlockPool(num_blocks)
        self.tree = RadixTree(block_size)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._locks: dict[str, Node] = {}
        self._committed: dict[str, int] = {}   # blocks of the request already in the tree

    # ---- queries -------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def num_available_blocks(self) -> int:
        return self.pool.num_free + self.tree.num_evictable_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-only blocks count as available)."""
        return 1.0 - self.num_available_blocks / self.num_blocks

    def num_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix the tree holds now (a peek: locks nothing)."""
        if not self.prefix_cache or request.sampling_params.prompt_logprobs is not None:
            return 0
        tokens = request.all_token_ids[:request.num_tokens - 1]
        return self.tree.match_length(tokens, namespace_of(request)) * self.block_size

    def lookup(self, request: Request, source: Request | None = None) -> PrefixMatch:
        """The cached prefix a (re)starting request can reuse: whole blocks, then a tail.

        At least one token is always left to compute, so the step yields logits. `source` is
        an n > 1 sibling whose computed prompt blocks may be shared when the tree is off.
        """
        limit = request.num_tokens - 1
        if request.sampling_params.prompt_logprobs is not None:
            return NO_MATCH  # every prompt position must be computed for its logprobs
        if self.prefix_cache:
            tokens = request.all_token_ids[:limit]
            node, blocks = self.tree.match(tokens, namespace_of(request))
            tail, tail_tokens = self.tree.best_tail(node, tokens[len(blocks) * self.block_size:])
            return PrefixMatch(blocks, node if blocks else None, tail, tail_tokens)
        if source is not None and source.request_id in self._tables:
            usable = min(limit, source.num_computed_tokens, source.num_prompt_tokens)
            return PrefixMatch(self._tables[source.request_id][:usable // self.block_size], None)
        return NO_MATCH

    # ---- updates -------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int,
                 match: PrefixMatch = NO_MATCH) -> list[int] | None:
        """Grow the request's table to hold `num_new_tokens` more tokens.

        A first allocation may adopt a prefix `match` (the request's num_computed_tokens must
        already count it). Returns the newly added block ids, or None (and changes nothing)
        when not enough blocks are free or evictable.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        adopted = table is None and (bool(match.block_ids) or match.tail is not None)
        if table is None:
            table = list(match.block_ids)
            if adopted:
                self._adopt(rid, match, table)
        total_tokens = request.num_computed_tokens + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(table)
        if needed > self.num_available_blocks:
            if adopted:
                if match.tail is not None:
                    self.tree.restore_tail(match.tail)
                self._release(rid, table)
            return None
        if needed > self.pool.num_free:
            freed = self.tree.evict(needed - self.pool.num_free)
            self.stats.evicted_blocks += len(freed)
            self.pool.put_back(freed)
        new_blocks = self.pool.take(max(needed, 0))
        table.extend(new_blocks)
        self._tables[rid] = table
        self._committed.setdefault(rid, len(match.block_ids) if match.node else 0)
        return new_blocks

    def commit(self, request: Request) -> None:
        """Cache the request's full, computed blocks in the tree (called after each step)."""
        rid = request.request_id
        if not self.prefix_cache or rid not in self._tables:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(self._tables[rid]))
        if num_full <= self._committed.get(rid, 0):
            return
        tokens = request.all_token_ids[:num_full * self.block_size]
        node, _ = self.tree.insert(tokens, self._tables[rid][:num_full], namespace_of(request))
        self._relock(rid, node)
        self._committed[rid] = num_full

    def free(self, request: Request) -> None:
        """Release all the request's blocks; cached ones stay in the tree until evicted."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table is not None:
            self._keep_tail(request, table)
            self._release(rid, table)
        self._committed.pop(rid, None)

    def evict_all(self) -> None:
        freed = self.tree.evict(self.num_blocks)
        self.stats.evicted_blocks += len(freed)
        self.pool.put_back(freed)

    # ---- internals -----------------------------------------------------------------------

    def _adopt(self, rid: str, match: PrefixMatch, table: list[int]) -> None:
        if match.node is not None:
            self.tree.lock(match.node)
            self._locks[rid] = match.node
        self.pool.incref(match.block_ids)
        if match.tail is not None:
            tail_block = self.tree.take_tail(match.tail)
            self.pool.incref([tail_block])
            table.append(tail_block)

    def _keep_tail(self, request: Request, table: list[int]) -> None:
        """Cache the request's partly filled last block as a tail after its whole blocks (run
        `commit` first): the tokens it holds need not be computed again."""
        rid = request.request_id
        num_full = self._committed.get(rid, 0)
        num_tail = request.num_computed_tokens - num_full * self.block_size
        if not self.prefix_cache or not 0 < num_tail < self.block_size or len(table) <= num_full:
            return
        block = table[num_full]
        if self.pool.ref_counts[block] != 1 or self.tree.contains_block(block):
            return   # not this request's own (cannot happen with the tree on; kept safe)
        node = self._locks.get(rid) or self.tree.root(namespace_of(request))
        start = num_full * self.block_size
        tokens = request.all_token_ids[start:start + num_tail]
        _, dropped = self.tree.insert_tail(node, tokens, block)
        self.pool.put_back(dropped)

    def _release(self, rid: str, table: list[int]) -> None:
        # Tail blocks first, so the free list hands out a request's later blocks first.
        unused = self.pool.decref(table[::-1])
        self.pool.put_back([b for b in unused if not self.tree.contains_block(b)])
        node = self._locks.pop(rid, None)
        if node is not None:
            self.tree.unlock(node)

    def _relock(self, rid: str, node: Node) -> None:
        old = self._locks.get(rid)
        if old is node:
            return
        self.tree.lock(node)  # lock the new node before unlocking the old: no gap to evict in
        self._locks[rid] = node
        if old is not None:
            self.tree.unlock(old)

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        refs: Counter[int] = Counter()
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice"
            refs.update(table)
        for block in range(self.num_blocks):
            assert self.pool.ref_counts[block] == refs[block], (
                f"block {block}: ref count {self.pool.ref_counts[block]} != {refs[block]} users")
        free = self.pool.free_block_ids()
        assert len(set(free)) == len(free), "a block is on the free list twice"
        free_set = set(free)
        for block in range(self.num_blocks):
            cached = self.tree.contains_block(block)
            if block in free_set:
                assert refs[block] == 0 and not cached, f"free block {block} is in use"
            else:
                assert refs[block] > 0 or cached, f"block {block} leaked"
        for rid in self._locks:
            assert rid in self._tables, f"request {rid} locks the tree without blocks"
        expected = Counter(id(node) for node in self._locks.values())
        self.tree.check_integrity(dict(expected))
        for block, count in refs.items():
            if self.tree.contains_block(block):
                assert self.tree.node_of(block).lock_count > 0, (
                    f"block {block} is used but its node is unlocked")
