"""RadixTree: deterministic cases (splits, duplicates, LRU, locks, namespaces) and a stateful
property test against a plain dict model of the cached block prefixes."""

from __future__ import annotations

import heapq

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from tokenmill.kv.radix_tree import RadixTree

BS = 2
NS = ("default",)


def seq(*blocks: str) -> list[int]:
    """Token ids from block names: seq("ab", "cd") -> [a, b, c, d] as small ints."""
    return [ord(ch) - ord("a") for block in blocks for ch in block]


def children(node) -> list:
    return list(node.children.values())


# ---- deterministic ------------------------------------------------------------------------

def test_match_on_empty_tree_finds_nothing():
    tree = RadixTree(BS)
    node, blocks = tree.match(seq("ab", "cd"), NS)
    assert blocks == [] and node is tree.root(NS)


def test_match_uses_whole_blocks_only():
    tree = RadixTree(BS)
    tree.insert(seq("ab", "cd"), [10, 11], NS)
    assert tree.match(seq("ab", "cd"), NS)[1] == [10, 11]
    assert tree.match(seq("ab", "cd") + [9], NS)[1] == [10, 11]
    assert tree.match(seq("ab", "c"), NS)[1] == [10]      # half a block does not count
    assert tree.match(seq("ab", "ce"), NS)[1] == [10]
    assert tree.match(seq("ba"), NS)[1] == []
    tree.check_integrity({})


def test_match_on_partial_edge_splits_the_node():
    tree = RadixTree(BS)
    leaf, added = tree.insert(seq("ab", "cd", "ef"), [1, 2, 3], NS)
    assert added == 3 and leaf.block_ids == [1, 2, 3]
    root = tree.root(NS)
    assert len(children(root)) == 1

    node, blocks = tree.match(seq("ab", "cd", "xx"), NS)
    assert blocks == [1, 2]
    assert node.block_ids == [1, 2] and node.parent is root
    assert children(root) == [node]
    assert children(node) == [leaf] and leaf.block_ids == [3] and leaf.parent is node
    assert leaf.key == tuple(seq("ef")) and node.key == tuple(seq("ab", "cd"))
    assert tree.node_of(1) is node and tree.node_of(3) is leaf
    assert tree.num_cached_blocks == 3 and tree.num_evictable_blocks == 3
    tree.check_integrity({})


def test_insert_diverging_run_splits_and_adds_a_sibling_leaf():
    tree = RadixTree(BS)
    first, _ = tree.insert(seq("ab", "cd", "ef"), [1, 2, 3], NS)
    second, added = tree.insert(seq("ab", "xy", "zz"), [7, 8, 9], NS)
    assert added == 2 and second.block_ids == [8, 9]
    head = second.parent
    assert head.block_ids == [1] and first.parent is head and first.block_ids == [2, 3]
    assert sorted(n.block_ids[0] for n in children(head)) == [2, 8]
    assert not tree.contains_block(7)      # its tokens were cached in block 1 already
    assert tree.num_cached_blocks == 5
    tree.check_integrity({})


def test_insert_of_cached_prefix_adds_nothing():
    tree = RadixTree(BS)
    leaf, _ = tree.insert(seq("ab", "cd", "ef"), [1, 2, 3], NS)
    node, added = tree.insert(seq("ab", "cd", "ef"), [4, 5, 6], NS)
    assert added == 0 and node is leaf and tree.num_cached_blocks == 3
    node, added = tree.insert(seq("ab", "cd"), [4, 5], NS)
    assert added == 0 and node.block_ids == [1, 2]   # split: the prefix is a node now
    assert not any(tree.contains_block(b) for b in (4, 5, 6))
    node, added = tree.insert(seq("ab", "cd", "ef", "gh"), [4, 5, 6, 7], NS)
    assert added == 1 and node.block_ids == [7] and node.parent is leaf
    tree.check_integrity({})


def test_namespaces_never_share_blocks():
    tree = RadixTree(BS)
    tree.insert(seq("ab", "cd"), [1, 2], ("a",))
    assert tree.match(seq("ab", "cd"), ("b",))[1] == []
    node, added = tree.insert(seq("ab", "cd"), [3, 4], ("b",))
    assert added == 2
    assert tree.match(seq("ab", "cd"), ("a",))[1] == [1, 2]
    assert tree.match(seq("ab", "cd"), ("b",))[1] == [3, 4]
    assert tree.root(("a",)) is not tree.root(("b",))
    tree.check_integrity({})


def test_lru_evicts_least_recently_used_leaf_first():
    tree = RadixTree(BS)
    tree.insert(seq("aa", "bb"), [1, 2], NS)     # oldest insert
    tree.insert(seq("cc", "dd"), [3, 4], NS)
    tree.insert(seq("ee", "ff"), [5, 6], NS)
    tree.match(seq("aa", "bb"), NS)              # now the most recently used
    assert tree.evict(1) == [3, 4]
    assert tree.evict(1) == [5, 6]
    assert tree.evict(1) == [1, 2]
    assert tree.num_cached_blocks == 0 and tree.num_evictable_blocks == 0
    tree.check_integrity({})


def test_lru_insert_counts_as_use_and_partial_match_touches_only_the_matched_part():
    tree = RadixTree(BS)
    tree.insert(seq("aa", "bb", "cc"), [1, 2, 3], NS)
    tree.insert(seq("dd"), [4], NS)
    tree.match(seq("aa"), NS)                    # splits: [1] is fresh, [2, 3] keeps its age
    # Leaves: [2, 3] (inserted first) and [4]. The old tail goes first, then [4], then [1].
    assert tree.evict(1) == [2, 3]
    assert tree.evict(1) == [4]
    assert tree.evict(1) == [1]
    tree.check_integrity({})


def test_evict_removes_children_before_parent_and_stops_when_enough():
    tree = RadixTree(BS)
    tree.insert(seq("aa", "bb"), [1, 2], NS)
    tree.insert(seq("aa", "bb", "cc"), [1, 2, 3], NS)   # child [3] under [1, 2]
    assert tree.evict(1) == [3]                  # the parent is no leaf until its child goes
    assert tree.num_cached_blocks == 2
    assert tree.evict(5) == [1, 2]               # frees what it can, no more
    assert tree.evict(1) == []
    tree.check_integrity({})


def test_locked_path_is_never_evicted():
    tree = RadixTree(BS)
    node, _ = tree.insert(seq("aa", "bb", "cc"), [1, 2, 3], NS)
    other, _ = tree.insert(seq("aa", "xx"), [1, 9], NS)
    tree.lock(node)
    assert tree.num_evictable_blocks == 1        # only [9]: the lock covers [1] and [2, 3]
    assert tree.evict(10) == [9]
    assert tree.num_cached_blocks == 3
    tree.check_integrity({id(node): 1})
    tree.unlock(node)
    assert tree.num_evictable_blocks == 3
    assert sorted(tree.evict(10)) == [1, 2, 3]
    tree.check_integrity({})


def test_split_of_a_locked_node_keeps_lock_counts():
    tree = RadixTree(BS)
    node, _ = tree.insert(seq("aa", "bb", "cc"), [1, 2, 3], NS)
    tree.lock(node)
    tree.lock(node)
    head, blocks = tree.match(seq("aa"), NS)
    assert blocks == [1] and head is not node and node.parent is head
    assert head.lock_count == 2 and node.lock_count == 2
    tree.check_integrity({id(node): 2})
    tree.lock(head)
    tree.check_integrity({id(node): 2, id(head): 1})
    tree.unlock(node)
    tree.unlock(node)
    assert tree.num_evictable_blocks == 2        # [2, 3]; [1] is still locked via head
    assert tree.evict(10) == [2, 3]
    tree.unlock(head)
    assert tree.evict(10) == [1]
    tree.check_integrity({})


# ---- property: random operations against a dict model --------------------------------------

BASES = [[(i * 7 + j * 3) % 5 for j in range(24)] for i in range(3)]
NAMESPACES = [("a",), ("b",)]


def _shared_length(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@st.composite
def token_runs(draw, max_len: int = 14) -> list[int]:
    """Token lists that often share prefixes: a prefix of a fixed base plus a short tail."""
    base = draw(st.sampled_from(BASES))
    k = draw(st.integers(0, max_len))
    tail = draw(st.lists(st.integers(0, 2), max_size=max_len - k))
    return base[:k] + tail


class RadixTreeMachine(RuleBasedStateMachine):
    """Model: (namespace, token prefix of whole blocks) -> block id, kept prefix-closed; and
    (namespace, whole-block prefix, tail tokens) -> block id for the tails."""

    @initialize(block_size=st.sampled_from([1, 2, 4]))
    def setup(self, block_size: int) -> None:
        self.bs = block_size
        self.tree = RadixTree(block_size)
        self.cached: dict[tuple, int] = {}
        self.tails: dict[tuple, int] = {}
        self.locks: list[tuple] = []             # (node, namespace, prefix tokens)
        self.next_block = 0

    def _prefixes(self, tokens: list[int], namespace) -> list[tuple]:
        bs = self.bs
        return [(namespace, tuple(tokens[:(i + 1) * bs])) for i in range(len(tokens) // bs)]

    def _expected_match(self, tokens: list[int], namespace) -> list[int]:
        blocks = []
        for key in self._prefixes(tokens, namespace):
            if key not in self.cached:
                break
            blocks.append(self.cached[key])
        return blocks

    def _locked_keys(self) -> set[tuple]:
        keys = set()
        for _, namespace, tokens in self.locks:
            keys.update(self._prefixes(list(tokens), namespace))
        return keys

    @rule(tokens=token_runs(), namespace=st.sampled_from(NAMESPACES))
    def insert(self, tokens: list[int], namespace) -> None:
        num = len(tokens) // self.bs
        if num == 0:
            return
        tokens = tokens[:num * self.bs]
        blocks = list(range(self.next_block, self.next_block + num))
        self.next_block += num
        depth = len(self._expected_match(tokens, namespace))
        node, added = self.tree.insert(tokens, blocks, namespace)
        assert added == num - depth
        for key, block in zip(self._prefixes(tokens, namespace)[depth:], blocks[depth:]):
            self.cached[key] = block
        last = self.cached[self._prefixes(tokens, namespace)[-1]]
        assert self.tree.node_of(last) is node and node.block_ids[-1] == last

    @rule(tokens=token_runs(), namespace=st.sampled_from(NAMESPACES), lock=st.booleans())
    def match(self, tokens: list[int], namespace, lock: bool) -> None:
        node, blocks = self.tree.match(tokens, namespace)
        assert blocks == self._expected_match(tokens, namespace)
        if not blocks:
            assert node is self.tree.root(namespace)
            return
        assert self.tree.node_of(blocks[-1]) is node
        assert node.block_ids == blocks[len(blocks) - len(node.block_ids):]
        if lock:
            self.tree.lock(node)
            self.locks.append((node, namespace, tuple(tokens[:len(blocks) * self.bs])))

    def _tail_parent(self, tokens: list[int], namespace):
        """The node of `tokens`' whole blocks, when they are all cached; and the rest."""
        whole = len(tokens) // self.bs * self.bs
        if len(self._expected_match(tokens[:whole], namespace)) * self.bs != whole:
            return None, tokens[whole:]
        return self.tree.match(tokens[:whole], namespace)[0], tokens[whole:]

    def _near_tail(self, data, namespace) -> list[int]:
        """Tokens that often end in a tail: a cached run (or nothing) and a few more tokens."""
        runs = sorted(tokens for ns, tokens in self.cached if ns == namespace)
        head = list(data.draw(st.sampled_from(runs))) if runs and data.draw(st.booleans()) else []
        return head + data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=self.bs))

    @rule(data=st.data(), namespace=st.sampled_from(NAMESPACES))
    def insert_tail(self, data, namespace) -> None:
        tokens = self._near_tail(data, namespace)
        node, rest = self._tail_parent(tokens, namespace)
        if node is None or not rest:
            return
        head = (namespace, tuple(tokens[:len(tokens) - len(rest)]))
        block, self.next_block = self.next_block, self.next_block + 1
        ours = {key[2]: b for key, b in self.tails.items() if key[:2] == head}
        covered = any(key[:len(rest)] == tuple(rest) for key in ours)
        cached, dropped = self.tree.insert_tail(node, rest, block)
        assert cached == (not covered)
        expected_drop = [] if covered else [b for k, b in ours.items() if tuple(rest)[:len(k)] == k]
        assert sorted(dropped) == sorted(expected_drop)
        if cached:
            self.tails = {k: b for k, b in self.tails.items() if b not in dropped}
            self.tails[head + (tuple(rest),)] = block

    @rule(data=st.data(), namespace=st.sampled_from(NAMESPACES), restore=st.booleans())
    def take_tail(self, data, namespace, restore: bool) -> None:
        tokens = self._near_tail(data, namespace)
        node, rest = self._tail_parent(tokens, namespace)
        if node is None:
            return
        head = (namespace, tuple(tokens[:len(tokens) - len(rest)]))
        shared = {k: _shared_length(k[2], rest) for k in self.tails if k[:2] == head}
        best = max(shared.values(), default=0)
        tail, count = self.tree.best_tail(node, rest)
        assert count == best and (tail is None) == (best == 0)
        if tail is None:
            return
        key = head + (tail.key,)
        assert shared[key] == best
        assert self.tree.take_tail(tail) == self.tails.pop(key)
        if restore:
            self.tree.restore_tail(tail)
            self.tails[key] = tail.block_ids[0]

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        index = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(index)
        self.tree.unlock(node)

    @rule(num=st.integers(0, 8))
    def evict(self, num: int) -> None:
        locked = self._locked_keys()
        evictable = {key for key in self.cached if key not in locked} | set(self.tails)
        expected = lru_by_walking(self.tree, num)
        freed = self.tree.evict(num)
        assert freed == expected, "not the least recently used leaves, in order"
        assert len(set(freed)) == len(freed)
        by_block = {block: key for key, block in (*self.cached.items(), *self.tails.items())}
        freed_keys = {by_block[block] for block in freed}
        assert freed_keys <= evictable, "evicted a locked or unknown block"
        assert len(freed) >= min(num, len(evictable))
        for key in freed_keys:
            del (self.cached if key in self.cached else self.tails)[key]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity(dict(Counter(id(node) for node, _, _ in self.locks)))
        assert self.tree.num_cached_blocks == len(self.cached) + len(self.tails)
        for (namespace, tokens), block in self.cached.items():
            assert self.tree.contains_block(block)
            if len(tokens) > self.bs:            # prefix-closed: the parent run is cached too
                assert (namespace, tokens[:-self.bs]) in self.cached
        for (namespace, head, _), block in self.tails.items():
            assert self.tree.contains_block(block) and self.tree.node_of(block).is_leaf
            assert not head or (namespace, head) in self.cached   # its whole blocks too
        locked = self._locked_keys()
        assert locked <= set(self.cached)
        assert self.tree.num_evictable_blocks == len(set(self.cached) - locked) + len(self.tails)


def lru_by_walking(tree: RadixTree, num_blocks: int) -> list[int]:
    """The blocks evict(num_blocks) must free, found by walking the whole tree: unlocked
    leaves least recently used first, a parent joining once its last child or tail is gone."""
    nodes = list(tree._nodes())
    left = {id(n): len(n.children) + len(n.tails) for n in nodes}
    heap = [(n.last_access, id(n), n) for n in nodes if left[id(n)] == 0 and n.lock_count == 0]
    heapq.heapify(heap)
    freed: list[int] = []
    while heap and len(freed) < num_blocks:
        _, _, node = heapq.heappop(heap)
        freed.extend(node.block_ids)
        parent = node.parent
        left[id(parent)] = left.get(id(parent), 0) - 1
        if not parent.is_root and left[id(parent)] == 0 and parent.lock_count == 0:
            heapq.heappush(heap, (parent.last_access, id(parent), parent))
    return freed


RadixTreeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
TestRadixTreeMachine = RadixTreeMachine.TestCase
