"""KVCacheManager: deterministic cases and a stateful property test that drives it the way the
scheduler does (lookup + allocate, compute, commit, finish, preempt, evict) and checks, after
every step, `check_integrity()` plus what a block holds (a shadow of its token prefix)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from tokenmill.kv.manager import NO_MATCH, KVCacheManager, namespace_of
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None,
                 prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=1000, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return Request(rid, list(tokens), params, frozenset(), seed=0, max_tokens=1000,
                   cache_salt=salt)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None):
    """Scheduler-style admission: lookup, count the hit as computed, allocate the rest."""
    match = kv.lookup(request)
    request.num_computed_tokens = match.num_tokens(kv.block_size)
    if num_new is None:
        num_new = request.num_tokens - request.num_computed_tokens
    blocks = kv.allocate(request, num_new, match)
    if blocks is None:
        request.num_computed_tokens = 0
    return match, blocks


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    request.num_computed_tokens += num_tokens
    kv.commit(request)


def run_to_end(kv: KVCacheManager, request: Request) -> None:
    """Admit, compute the whole prompt, commit and free: its full blocks stay cached."""
    _, blocks = admit(kv, request)
    assert blocks is not None
    compute(kv, request, request.num_tokens - request.num_computed_tokens)
    kv.free(request)
    kv.check_integrity()


# ---- deterministic ------------------------------------------------------------------------

def test_lookup_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("a", list(range(12))))
    assert kv.tree.num_cached_blocks == 3
    exact = kv.lookup(make_request("b", list(range(12))))       # exactly 3 full blocks
    assert exact.num_tokens(4) == 8 and exact.node is not None
    longer = kv.lookup(make_request("c", list(range(12)) + [99]))
    assert longer.num_tokens(4) == 12
    shorter = kv.lookup(make_request("d", list(range(5))))
    assert shorter.num_tokens(4) == 4
    assert kv.lookup(make_request("e", [0])).block_ids == []
    kv.check_integrity()


def test_lookup_skips_the_cache_when_prompt_logprobs_are_wanted():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("a", list(range(12))))
    assert kv.lookup(make_request("b", list(range(13)), prompt_logprobs=1)) is NO_MATCH


def test_adopted_prefix_is_shared_and_locked():
    kv = KVCacheManager(num_blocks=6, block_size=4, prefix_cache=True)
    first = make_request("a", list(range(9)))
    run_to_end(kv, first)
    cached = kv.tree.match(list(range(8)), namespace_of(first))[1]
    assert len(cached) == 2
    second = make_request("b", list(range(8)) + [50, 51])
    match, blocks = admit(kv, second)
    assert match.block_ids == cached and len(blocks) == 1
    assert kv.block_ids("b") == cached + blocks
    assert second.num_computed_tokens == 8
    assert kv.tree.num_evictable_blocks == 1     # the adopted path is locked; "a"'s tail is not
    assert all(kv.pool.ref_counts[b] == 1 for b in kv.block_ids("b"))
    # Fill the rest of the pool: the locked prefix must survive the pressure.
    third = make_request("c", [70 + i for i in range(12)])
    assert admit(kv, third)[1] is not None
    assert kv.pool.num_free == 0 and kv.num_available_blocks == 0
    assert admit(kv, make_request("d", [90, 91]))[1] is None
    assert all(kv.tree.contains_block(b) for b in cached)
    kv.check_integrity()


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2, prefix_cache=True)
    run_to_end(kv, make_request("a", [1, 2, 3, 4, 5]))        # caches 2 blocks
    before = (kv.pool.num_free, kv.tree.num_evictable_blocks, kv.tree.num_cached_blocks)
    big = make_request("b", [1, 2, 3, 4] + list(range(10, 20)))
    match, blocks = admit(kv, big)
    assert len(match.block_ids) == 2 and blocks is None
    assert (kv.pool.num_free, kv.tree.num_evictable_blocks, kv.tree.num_cached_blocks) == before
    assert kv.block_ids("b") == [] and big.num_computed_tokens == 0
    kv.check_integrity()


def test_eviction_under_pressure_takes_least_recently_matched_leaf():
    kv = KVCacheManager(num_blocks=4, block_size=2, prefix_cache=True)
    for rid, base in (("a", 10), ("b", 20), ("c", 30)):
        run_to_end(kv, make_request(rid, [base, base + 1]))   # one cached block each, no tail
    a_block = kv.tree.match([10, 11], ("x",))[1]
    assert a_block == []                                                 # other namespace
    a_block = kv.lookup(make_request("a2", [10, 11, 12])).block_ids      # touches "a"
    b_block = kv.lookup(make_request("b2", [20, 21, 22])).block_ids
    c_block = kv.lookup(make_request("c2", [30, 31, 32])).block_ids
    kv.lookup(make_request("a3", [10, 11, 12]))                          # "a" newest again
    assert kv.pool.num_free == 1 and kv.tree.num_cached_blocks == 3
    newcomer = make_request("d", [40, 41, 42, 43])                       # needs 2 blocks
    assert admit(kv, newcomer)[1] is not None
    assert not kv.tree.contains_block(b_block[0])                        # LRU went first
    assert kv.tree.contains_block(a_block[0]) and kv.tree.contains_block(c_block[0])
    assert kv.stats.evicted_blocks == 1
    kv.check_integrity()


def test_namespaces_do_not_share():
    kv = KVCacheManager(num_blocks=8, block_size=2, prefix_cache=True)
    run_to_end(kv, make_request("a", [1, 2, 3, 4, 5], salt="alice"))
    assert kv.lookup(make_request("b", [1, 2, 3, 4, 5], salt="bob")).block_ids == []
    assert kv.lookup(make_request("c", [1, 2, 3, 4, 5])).block_ids == []
    assert len(kv.lookup(make_request("d", [1, 2, 3, 4, 5], salt="alice")).block_ids) == 2


def test_without_prefix_cache_nothing_is_cached():
    kv = KVCacheManager(num_blocks=8, block_size=2, prefix_cache=False)
    for rid in "abc":
        request = make_request(rid, [1, 2, 3, 4, 5])
        match, blocks = admit(kv, request)
        assert match is NO_MATCH and len(blocks) == 3
        compute(kv, request, 5)
        assert kv.tree.num_cached_blocks == 0
        kv.free(request)
        assert kv.pool.num_free == 8
        kv.check_integrity()


def test_sibling_shares_source_prompt_blocks_without_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2, prefix_cache=False)
    source = make_request("s", [1, 2, 3, 4, 5])
    admit(kv, source)
    compute(kv, source, 5)
    sibling = make_request("t", [1, 2, 3, 4, 5])
    match = kv.lookup(sibling, source)
    assert match.block_ids == kv.block_ids("s")[:2] and match.node is None
    sibling.num_computed_tokens = 4
    blocks = kv.allocate(sibling, 1, match)
    assert len(blocks) == 1 and kv.block_ids("t") == kv.block_ids("s")[:2] + blocks
    assert [kv.pool.ref_counts[b] for b in kv.block_ids("s")] == [2, 2, 1]
    kv.check_integrity()
    kv.free(source)
    kv.check_integrity()
    kv.free(sibling)
    assert kv.pool.num_free == 8
    kv.check_integrity()


def test_usage_counts_only_blocks_held_by_requests():
    kv = KVCacheManager(num_blocks=4, block_size=2, prefix_cache=True)
    request = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, request)
    assert kv.usage == 0.75
    compute(kv, request, 5)
    kv.free(request)
    assert kv.usage == 0.0 and kv.tree.num_cached_blocks == 3   # two whole blocks, a tail
    kv.evict_all()
    assert kv.pool.num_free == 4 and kv.tree.num_cached_blocks == 0


def test_a_finished_requests_partial_block_is_taken_over_by_its_continuation():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("a", list(range(10))))       # two whole blocks and [8, 9]
    tail_block = kv.tree.node_of(kv.tree.match(list(range(8)), (None,))[1][-1]).tails[(8, 9)]
    assert kv.tree.num_cached_blocks == 3 and kv.tree.num_evictable_blocks == 3
    nxt = make_request("b", list(range(10)) + [50, 51])       # the next turn of the chat
    match, blocks = admit(kv, nxt)
    assert match.tail is tail_block and match.num_tokens(4) == 10
    assert nxt.num_computed_tokens == 10 and len(blocks) == 0   # [8, 9, 50, 51] fills it
    assert kv.block_ids("b") == match.block_ids + tail_block.block_ids
    assert not kv.tree.contains_block(tail_block.block_ids[0])   # b's own now: never shared
    kv.check_integrity()
    compute(kv, nxt, 2)
    kv.free(nxt)
    assert kv.tree.num_cached_blocks == 3 and kv.pool.num_free == 5   # [8, 9, 50, 51] whole
    kv.check_integrity()


def test_a_tail_gives_the_tokens_a_prompt_shares_with_it():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7]))    # tail [5, 6, 7]
    match, blocks = admit(kv, make_request("b", [1, 2, 3, 4, 5, 6, 9, 9, 9]))
    assert match.num_tokens(4) == 6 and match.tail_tokens == 2 and len(blocks) == 1
    assert kv.lookup(make_request("c", [1, 2, 3, 4, 5, 6, 7, 8])).tail is None   # taken
    assert kv.lookup(make_request("d", [1, 2, 3, 4, 5])).tail is None   # one token left to do
    kv.check_integrity()


def test_a_failed_allocation_leaves_the_tail_cached():
    kv = KVCacheManager(num_blocks=3, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("a", [1, 2, 3, 4, 5, 6]))       # block [1-4] and tail [5, 6]
    before = (kv.pool.num_free, kv.tree.num_evictable_blocks, kv.tree.num_cached_blocks)
    big = make_request("b", [1, 2, 3, 4, 5, 6] + list(range(10, 20)))
    match, blocks = admit(kv, big)
    assert match.tail is not None and blocks is None            # needs 4 blocks of 3
    assert (kv.pool.num_free, kv.tree.num_evictable_blocks, kv.tree.num_cached_blocks) == before
    assert kv.lookup(make_request("c", [1, 2, 3, 4, 5, 6, 7])).tail_tokens == 2
    kv.check_integrity()


def test_a_preempted_request_resumes_from_its_own_tail():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    request = make_request("a", list(range(11)))
    admit(kv, request, num_new=6)
    compute(kv, request, 6)                                      # [0-3] and [4, 5]
    kv.free(request)                                             # preempted
    request.num_computed_tokens = 0
    match, blocks = admit(kv, request)
    assert match.num_tokens(4) == 6 and request.num_computed_tokens == 6
    kv.check_integrity()


def test_tails_are_evicted_before_their_blocks_and_kept_only_once():
    kv = KVCacheManager(num_blocks=4, block_size=4, prefix_cache=True)
    run_to_end(kv, make_request("a", [1, 2, 3, 4, 5]))          # [1-4], tail [5]
    run_to_end(kv, make_request("b", [1, 2, 3, 4, 5, 6]))       # takes [5], leaves [5, 6]
    run_to_end(kv, make_request("c", [1, 2, 3, 4, 5]))          # [5] is in [5, 6]: not kept
    assert kv.tree.num_cached_blocks == 2 and kv.pool.num_free == 2
    kv.evict_all()
    assert kv.tree.num_cached_blocks == 0 and kv.pool.num_free == 4
    kv.check_integrity()


def test_no_tails_without_the_prefix_cache():
    kv = KVCacheManager(num_blocks=4, block_size=4, prefix_cache=False)
    run_to_end(kv, make_request("a", [1, 2, 3, 4, 5]))
    assert kv.tree.num_cached_blocks == 0 and kv.pool.num_free == 4


# ---- property: random scheduler-like operation sequences ----------------------------------

BASES = [[(i * 7 + j * 3) % 5 for j in range(32)] for i in range(3)]
SALTS = [None, "s"]
MAX_LIVE = 6


@st.composite
def prompts(draw, max_len: int) -> list[int]:
    base = draw(st.sampled_from(BASES))
    k = draw(st.integers(0, max_len))
    tail = draw(st.lists(st.integers(0, 2), min_size=1 if k == 0 else 0, max_size=max_len - k))
    return base[:k] + tail


def _shared_length(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class KVManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 16), block_size=st.sampled_from([1, 2, 4]),
                prefix_cache=st.booleans())
    def setup(self, num_blocks: int, block_size: int, prefix_cache: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, prefix_cache)
        self.bs = block_size
        self.max_len = 6 * block_size + 3
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.fresh: dict[str, set[int]] = {}        # blocks handed to the request new
        self.adopted: dict[str, set[int]] = {}      # blocks it got from a prefix match
        self.in_tree: dict[str, set[int]] = {}      # its blocks known to be cached
        self.content: dict[int, tuple] = {}         # block -> (salt, token prefix)
        self.history: list[list[int]] = []          # token lists seen, for repeated prompts
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------------------

    def _key(self, request: Request, num_blocks: int) -> tuple:
        # The salt itself, not namespace_of(): the shadow must not trust the code under test.
        return (request.cache_salt, tuple(request.all_token_ids[:num_blocks * self.bs]))

    def _tree_blocks(self) -> set[int]:
        return {b for b in range(self.kv.num_blocks) if self.kv.tree.contains_block(b)}

    def _cached_keys(self) -> set[tuple]:
        return {self.content[b] for b in self._tree_blocks()}

    def _check_tail(self, request: Request, match) -> None:
        """The match's tail is the cached tail after its whole blocks that shares the most
        tokens with the request's (all but its last), and it holds those tokens."""
        start = len(match.block_ids) * self.bs
        wanted = request.all_token_ids[start:request.num_tokens - 1]
        best = 0
        for block in self._tree_blocks():
            salt, tokens = self.content[block]
            if (salt == request.cache_salt and start < len(tokens) < start + self.bs
                    and tokens[:start] == tuple(request.all_token_ids[:start])):
                best = max(best, _shared_length(tokens[start:], wanted))
        if not self.kv.prefix_cache or request.sampling_params.prompt_logprobs is not None:
            best = 0
        assert match.tail_tokens == best and (match.tail is None) == (best == 0)
        if match.tail is not None:
            salt, tokens = self.content[match.tail.block_ids[0]]
            assert salt == request.cache_salt
            assert tokens[:start + best] == tuple(request.all_token_ids[:start + best])

    def _pick(self, data, pool: dict[str, Request]) -> Request:
        return pool[data.draw(st.sampled_from(sorted(pool)))]

    def _needed(self, request: Request, num_new: int, num_held: int) -> int:
        return -(-(request.num_computed_tokens + num_new) // self.bs) - num_held

    def _allocate(self, request: Request, num_new: int, match=NO_MATCH):
        """allocate() plus the checks on what it hands out."""
        rid = request.request_id
        held = len(self.kv.block_ids(rid)) or len(match.block_ids) + (match.tail is not None)
        # Matched blocks in unlocked nodes stop being evictable once the match is adopted, and
        # a tail once it is taken.
        newly_locked = sum(1 for b in match.block_ids if self.kv.tree.node_of(b).lock_count == 0)
        available = self.kv.num_available_blocks - newly_locked - (match.tail is not None)
        needed = self._needed(request, num_new, held)
        others = {b for r in self.running if r != rid for b in self.kv.block_ids(r)}
        before = (self._tree_blocks(), self.kv.pool.num_free, self.kv.num_available_blocks)
        blocks = self.kv.allocate(request, num_new, match)
        assert (blocks is None) == (needed > available), (needed, available)
        if blocks is None:   # and nothing changed: the tree keeps what it held, tails too
            assert (self._tree_blocks(), self.kv.pool.num_free,
                    self.kv.num_available_blocks) == before
            return None
        assert len(blocks) == max(needed, 0)
        for block in blocks:
            assert block not in others, f"block {block} handed out while another request holds it"
            assert not self.kv.tree.contains_block(block)
            assert self.kv.pool.ref_counts[block] == 1
            self.content.pop(block, None)        # stale: it will be written again
        self.fresh.setdefault(rid, set()).update(blocks)
        return blocks

    def _computed(self, request: Request, num_new: int) -> None:
        """The request computed `num_new` tokens: record what its blocks now hold (the prefix
        up to the block's end, or up to the last computed token in a partly filled one)."""
        request.num_computed_tokens += num_new
        table = self.kv.block_ids(request.request_id)
        computed = request.num_computed_tokens
        for i in range(-(-computed // self.bs)):
            key = (request.cache_salt,
                   tuple(request.all_token_ids[:min(computed, (i + 1) * self.bs)]))
            old = self.content.get(table[i])
            if old is not None and len(old[1]) == (i + 1) * self.bs:
                assert old == key, "a full block holds other tokens"
            self.content[table[i]] = key
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(request.num_tokens % 3)   # "sample" the next token

    def _commit(self, request: Request) -> None:
        self.kv.commit(request)
        if not self.kv.prefix_cache:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.bs
        cached = self._cached_keys()
        for i in range(num_full):
            assert self._key(request, i + 1) in cached, "committed block run is not cached"
        self.in_tree[rid] = {b for b in self.kv.block_ids(rid) if self.kv.tree.contains_block(b)}

    def _release(self, request: Request) -> None:
        self._commit(request)
        self.kv.free(request)
        rid = request.request_id
        assert self.kv.block_ids(rid) == []
        self.history.append(list(request.all_token_ids))
        del self.running[rid]
        for book in (self.fresh, self.adopted, self.in_tree):
            book.pop(rid, None)

    # ---- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) + len(self.running) < MAX_LIVE)
    @rule(data=st.data(), salt=st.sampled_from(SALTS))
    def arrive(self, data, salt) -> None:
        """A new prompt, or a repeat / cut / extension of one seen before (multi-turn)."""
        tokens = data.draw(prompts(self.max_len - 4))
        if self.history and data.draw(st.booleans()):
            old = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.integers(1, len(old)))
            tokens = (old[:cut] + tokens[:data.draw(st.integers(0, 3))])[:self.max_len - 2]
        self.history.append(list(tokens))
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = make_request(rid, tokens, salt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data) -> None:
        request = self._pick(data, self.waiting)
        rid = request.request_id
        match = self.kv.lookup(request)
        limit = request.num_tokens - 1
        cached = self._cached_keys()
        expected = 0
        while expected < limit // self.bs and self._key(request, expected + 1) in cached:
            expected += 1
        assert len(match.block_ids) == (expected if self.kv.prefix_cache else 0)
        for i, block in enumerate(match.block_ids):
            assert self.kv.tree.contains_block(block)
            assert self.content[block] == self._key(request, i + 1)
        self._check_tail(request, match)
        request.num_computed_tokens = match.num_tokens(self.bs)
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = data.draw(st.integers(1, remaining))
        blocks = self._allocate(request, num_new, match)
        if blocks is None:
            request.num_computed_tokens = 0
            assert self.kv.block_ids(rid) == []
            return
        tail = [match.tail.block_ids[0]] if match.tail else []
        assert self.kv.block_ids(rid) == match.block_ids + tail + blocks
        self.adopted[rid] = set(match.block_ids)
        self.in_tree[rid] = set(match.block_ids)
        del self.waiting[rid]
        self.running[rid] = request
        self._computed(request, num_new)
        if data.draw(st.booleans()):
            self._commit(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data) -> None:
        """Compute a chunk (or one decode token) of a running request."""
        request = self._pick(data, self.running)
        remaining = request.num_tokens - request.num_computed_tokens
        assert remaining >= 1
        num_new = data.draw(st.integers(1, remaining))
        if self._allocate(request, num_new) is None:
            if data.draw(st.booleans()):
                self._preempt(request)
            return
        self._computed(request, num_new)
        if request.num_tokens >= self.max_len:
            self._release(request)
        elif data.draw(st.booleans()):
            self._commit(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def commit(self, data) -> None:
        self._commit(self._pick(data, self.running))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        self._release(self._pick(data, self.running))

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._preempt(self._pick(data, self.running))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        del self.waiting[self._pick(data, self.waiting).request_id]

    @rule(data=st.data(), salt=st.sampled_from(SALTS))
    def lookup_only(self, data, salt) -> None:
        """A lookup that is not followed by an allocation (it may split nodes, touch LRU)."""
        request = make_request("probe", data.draw(prompts(self.max_len)), salt)
        match = self.kv.lookup(request)
        for i, block in enumerate(match.block_ids):
            assert self.content[block] == self._key(request, i + 1)
        self._check_tail(request, match)

    @rule()
    def evict_all(self) -> None:
        self.kv.evict_all()
        assert self.kv.tree.num_evictable_blocks == 0
        # What is left is on a running request's path (its own blocks, or the cached copy of
        # a prefix it computed itself at the same time as another request).
        for block in self._tree_blocks():
            salt, tokens = self.content[block]
            assert any(r.cache_salt == salt and tuple(r.all_token_ids[:len(tokens)]) == tokens
                       for r in self.running.values()), f"unused block {block} survived"

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        kv.check_integrity()
        assert kv.num_available_blocks == kv.pool.num_free + kv.tree.num_evictable_blocks
        tree_blocks = self._tree_blocks()
        if not kv.prefix_cache:
            assert not tree_blocks
        # Fresh blocks belong to one request; any block two requests hold is a cached one.
        owners: dict[int, list[str]] = {}
        for rid in self.running:
            for block in kv.block_ids(rid):
                owners.setdefault(block, []).append(rid)
        for block, rids in owners.items():
            if len(rids) > 1:
                assert block in tree_blocks, f"block {block} shared by {rids} but not cached"
                assert sum(block in self.fresh[r] for r in rids) <= 1
                assert len({self.running[r].cache_salt for r in rids}) == 1
        # A running request's cached blocks (matched or committed) are locked: never evicted.
        for rid, blocks in self.in_tree.items():
            assert blocks <= tree_blocks, f"{rid} lost cached blocks {blocks - tree_blocks}"
        # The tree holds each (namespace, prefix) once and is prefix-closed.
        keys = [self.content[b] for b in tree_blocks]
        assert len(set(keys)) == len(keys), "a prefix is cached in two blocks"
        for namespace, tokens in keys:
            parent = (len(tokens) - 1) // self.bs * self.bs   # a tail's: its whole blocks
            if parent:
                assert (namespace, tokens[:parent]) in set(keys)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request in list(self.running.values()):
            self._release(request)
            self.kv.check_integrity()
        self.kv.evict_all()
        self.kv.check_integrity()
        assert self.kv.pool.num_free == self.kv.num_blocks
        assert self.kv.tree.num_cached_blocks == 0


KVManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                              deadline=None)
TestKVManagerMachine = KVManagerMachine.TestCase
