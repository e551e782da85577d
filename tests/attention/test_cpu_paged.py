"""The paged C++ CPU decode and prefill kernels against the torch reference backend (the
oracle)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.helpers.isa import avx2_tiles
from tokenmill import SamplingParams
from tokenmill.attention.cpu_paged import CpuPagedBackend, load_kernel
from tokenmill.attention.metadata import AttentionMetadata, PrefillSpan
from tokenmill.attention.torch_ref import TorchReferenceBackend, write_kv

BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 16, 64, 800

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler for the kernel")


def random_decode_batch(gen: torch.Generator, seq_lens: list[int], shared_prefix: int):
    """Block tables over a random pool; the first `shared_prefix` tokens' blocks are common."""
    shared = torch.randperm(NUM_BLOCKS, generator=gen)[:shared_prefix // BLOCK_SIZE].tolist()
    free = [b for b in torch.randperm(NUM_BLOCKS, generator=gen).tolist() if b not in shared]
    tables = []
    for seq_len in seq_lens:
        needed = -(-seq_len // BLOCK_SIZE)
        own = min(needed, len(shared)) if seq_len > shared_prefix else 0
        table = shared[:own] + [free.pop() for _ in range(needed - own)]
        tables.append(table)
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def metadata(table: torch.Tensor, seq_lens: list[int], window: int | None) -> AttentionMetadata:
    lens = torch.tensor(seq_lens, dtype=torch.long)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(seq_lens),
        decode_block_table=table, decode_seq_lens=lens, prefills=[], sliding_window=window)


def run_decode(backend, query, caches, meta):
    return backend._decode(query, caches[0], caches[1], meta)


def assert_matches_reference(gen: torch.Generator, kv_heads: int, groups: int,
                             table: torch.Tensor, seq_lens: list[int], window: int | None,
                             block_size: int = BLOCK_SIZE, head_dim: int = HEAD_DIM):
    """Random caches and queries; the kernel's decode output equals the reference's."""
    heads = kv_heads * groups
    shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    caches = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen) * 2
    meta = metadata(table, seq_lens, window)
    scale = head_dim ** -0.5
    expected = run_decode(TorchReferenceBackend(heads, kv_heads, head_dim, scale), query,
                          caches, meta)
    got = run_decode(CpuPagedBackend(heads, kv_heads, head_dim, scale), query, caches, meta)
    assert (got - expected).abs().max().item() < 1e-4


CASES = [  # (seq_lens, kv_heads, groups, shared prefix, sliding window)
    ([1], 1, 1, 0, None),
    ([16], 3, 3, 0, None),
    ([17, 32, 1, 600], 2, 1, 0, None),
    ([5 + 17 * i for i in range(33)], 3, 3, 0, None),
    ([300 + 7 * i for i in range(12)], 3, 3, 256, None),
    ([48, 1, 257, 600, 129], 3, 3, 0, 40),
    ([600, 33, 16, 1, 599], 2, 1, 0, 16),
    ([40, 600, 1], 1, 9, 0, None),         # more groups than the specialized kernels
    ([40, 600, 1, 77, 300], 2, 5, 64, None),    # one key per pass; heads together per item
    ([3, 250, 1, 77], 3, 9, 0, 30),        # generic groups, a window
    ([257, 270, 300, 20, 290, 400], 3, 3, 256, None),   # a shared run cut by a short request
    # requests over a common prefix of 4+ blocks attend it together, in chunks of 16 blocks or
    # more (with 2 threads: two a kv head for 3 kv heads, here 34 and 19 blocks; four for one)
    ([1100 + 3 * i for i in range(16)] + [40, 700], 3, 3, 1088, None),
    ([1100, 1090, 1200], 1, 9, 1024, None),
    ([600, 610, 5, 620, 900], 3, 1, 592, None),   # one query head per kv head; a 1-block tail
    # 12 rows (requests x query heads of a kv head) or more go in lanes, passes of 48 (16)
    ([300 + 5 * i for i in range(4)], 3, 3, 256, None),   # 12 rows: the fewest in lanes
    ([1100 + i for i in range(20)], 3, 3, 1088, None),     # 60 rows: passes of 48 and 12
    ([700 + 3 * i for i in range(13)], 2, 4, 640, None),   # 52: a last pass of 4 rows
    # below two requests per thread each context is cut into slices of blocks, merged after
    ([1000], 3, 3, 0, None),
    ([700, 3], 3, 3, 0, None),              # the short request's later slices are empty
    ([129, 500, 64], 3, 3, 0, None),
    ([1000], 3, 3, 0, 333),                 # a window starting inside a block
    ([800, 790], 2, 5, 512, 100),
    # two requests per thread or more: only contexts over 64 blocks are cut, longest slices first
    ([3000] + [130 + 20 * i for i in range(8)], 3, 3, 0, None),
    ([1024, 1025, 3, 2049, 77], 2, 1, 0, None),      # slice edges at and just past 64 blocks
    ([2500, 1100, 40, 60], 3, 3, 0, 1500),           # a window over two slices' worth
]


@pytest.mark.parametrize("seq_lens, kv_heads, groups, shared, window", CASES)
def test_kernel_matches_reference_decode(seq_lens, kv_heads, groups, shared, window):
    gen = torch.Generator().manual_seed(len(seq_lens) * 31 + kv_heads)
    assert_matches_reference(gen, kv_heads, groups, random_decode_batch(gen, seq_lens, shared),
                             seq_lens, window)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), kv_heads=st.sampled_from([1, 3]), groups=st.sampled_from([1, 3, 4]))
def test_kernel_matches_reference_over_shared_prefixes(data, kv_heads, groups):
    """Runs of requests sharing leading blocks of any length, diverging at any block, mixed with
    requests sharing nothing; batches of 1-20 cover both work splits (context slices below two
    requests per thread, whole requests above)."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, seq_lens = [], []
    for _ in range(data.draw(st.integers(1, 4), label="groups of requests")):
        prefix = [free.pop() for _ in range(data.draw(st.integers(0, 6), label="shared blocks"))]
        for _ in range(data.draw(st.integers(1, 5), label="requests in the group")):
            seq_len = data.draw(st.integers(1, 140), label="seq_len")
            needed = -(-seq_len // BLOCK_SIZE)
            own = min(needed, len(prefix))
            tables.append(prefix[:own] + [free.pop() for _ in range(needed - own)])
            seq_lens.append(seq_len)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    assert_matches_reference(gen, kv_heads, groups, table, seq_lens, None)


@pytest.mark.parametrize("block_size, head_dim", [(8, 64), (24, 40), (16, 72)])
def test_shared_prefix_rows_with_partial_register_tiles(block_size, head_dim):
    """Blocks and heads whose sizes leave 8-wide remainders in the shared-prefix tiles (keys
    per block, dims per value row); 7 requests x 3 query heads leave a partial row tile."""
    gen = torch.Generator().manual_seed(block_size * head_dim)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    prefix = [free.pop() for _ in range(13)]
    seq_lens = [13 * block_size + 1 + 9 * i for i in range(7)]
    tables = [prefix + [free.pop() for _ in range(-(-n // block_size) - 13)] for n in seq_lens]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    assert_matches_reference(gen, 2, 3, table, seq_lens, None, block_size, head_dim)


def assert_batch_matches_reference_on_threads(seq_lens: list[int], window: int | None,
                                              threads: int, seed: int) -> None:
    """A batch over a random pool (3 kv heads x 3 groups), the kernel on `threads` threads,
    whose count decides how contexts are cut."""
    gen = torch.Generator().manual_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_reference(gen, 3, 3, random_decode_batch(gen, seq_lens, 0), seq_lens,
                                 window)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=30, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 900), min_size=1, max_size=3),
       window=st.one_of(st.none(), st.integers(1, 400)), threads=st.sampled_from([1, 2, 3]))
def test_sliced_contexts_match_reference(seq_lens, window, threads):
    """Few requests, so contexts are cut into slices: any lengths, windows and thread counts
    (the slice count depends on them) give the reference's output."""
    assert_batch_matches_reference_on_threads(seq_lens, window, threads,
                                              seed=sum(seq_lens) * 7 + (window or 0))


@settings(max_examples=25, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 1600), min_size=4, max_size=8),
       window=st.one_of(st.none(), st.integers(1, 1200)), threads=st.sampled_from([1, 2]))
def test_long_contexts_among_many_requests_match_reference(seq_lens, window, threads):
    """Enough requests that each is one work item, except contexts over 64 blocks, which are
    cut into slices and merged: any mix of lengths and windows gives the reference's output."""
    assert_batch_matches_reference_on_threads(seq_lens, window, threads,
                                              seed=sum(seq_lens) * 11 + (window or 0))


def test_kernel_rejects_out_of_range_block():
    caches = (torch.zeros(4, BLOCK_SIZE, 1, HEAD_DIM), torch.zeros(4, BLOCK_SIZE, 1, HEAD_DIM))
    meta = metadata(torch.tensor([[9]]), [3], None)
    backend = CpuPagedBackend(1, 1, HEAD_DIM, 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        run_decode(backend, torch.zeros(1, 1, HEAD_DIM), caches, meta)


def random_prefill(gen: torch.Generator, cached: int, query_len: int, kv_heads: int,
                   groups: int, block_size: int, head_dim: int):
    """Caches over a random pool holding a request's `cached + query_len` tokens (the chunk's
    keys and values written, as the forward pass does first), its chunk's queries and span."""
    seq_len = cached + query_len
    table = torch.randperm(NUM_BLOCKS, generator=gen)[:-(-seq_len // block_size)]
    shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    caches = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    slots = (table.repeat_interleave(block_size) * block_size
             + torch.arange(block_size).repeat(len(table)))[cached:seq_len]
    key, value = (c.view(-1, kv_heads, head_dim)[slots] for c in caches)
    query = torch.randn(query_len, kv_heads * groups, head_dim, generator=gen) * 2
    span = PrefillSpan(query_start=0, query_len=query_len, seq_len=seq_len, block_table=table)
    return query, key, value, caches, span


def call_prefill(kernel, out, query, caches, block_table, seq_len, scale) -> bool:
    """The kernel on one chunk: every row of query, ending at seq_len."""
    spans = torch.tensor([[0, query.shape[0], seq_len, 0]])
    return kernel.paged_prefill_attention(out, query, *caches, spans, block_table, scale)


def run_prefill(backend, query, key, value, caches, span):
    return backend._prefill(query, key, value, caches[0], caches[1], span, None)


@settings(max_examples=40, deadline=None)
@given(cached=st.integers(0, 700), query_len=st.integers(1, 300),
       kv_heads=st.sampled_from([1, 3]), groups=st.sampled_from([1, 3, 4]),
       block_size=st.sampled_from([8, 16, 32]), head_dim=st.sampled_from([40, 64]),
       seed=st.integers(0, 2**16))
def test_prefill_kernel_matches_reference(cached, query_len, kv_heads, groups, block_size,
                                          head_dim, seed):
    # Chunks with and without cached context, block-aligned or not, partial register tiles
    # (rows = tokens x groups), GQA or not: causal attention over the paged context, read in
    # place, equals SDPA over the gathered copy with a causal mask.
    gen = torch.Generator().manual_seed(seed)
    args = random_prefill(gen, cached, query_len, kv_heads, groups, block_size, head_dim)
    heads, scale = kv_heads * groups, head_dim ** -0.5
    expected = run_prefill(TorchReferenceBackend(heads, kv_heads, head_dim, scale), *args)
    got = run_prefill(CpuPagedBackend(heads, kv_heads, head_dim, scale), *args)
    assert (got - expected).abs().max().item() < 1e-4


def random_mixed_step(gen: torch.Generator, decode_lens: list[int],
                      chunks: list[tuple[int, int]], kv_heads: int, groups: int):
    """A step's q/k/v (q a view into a wider projection, as in the model) and metadata:
    decodes of the given context lengths first, then prefill chunks of (cached, new) tokens,
    each request on its own random blocks of one pool."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))]
              for n in decode_lens + [c + q for c, q in chunks]]
    slots, spans, row = [], [], len(decode_lens)
    for table, n in zip(tables, decode_lens):
        slots.append(table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    for table, (cached, new) in zip(tables[len(decode_lens):], chunks):
        slots.extend(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                     for p in range(cached, cached + new))
        spans.append(PrefillSpan(row, new, cached + new, torch.tensor(table)))
        row += new
    heads, width = kv_heads * groups, max([len(t) for t in tables[:len(decode_lens)]] or [1])
    lens = torch.tensor(decode_lens, dtype=torch.long)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=len(decode_lens),
        decode_block_table=torch.tensor([t + [0] * (width - len(t))
                                         for t in tables[:len(decode_lens)]]).view(-1, width),
        decode_seq_lens=lens, prefills=spans)
    qkv = torch.randn(row, heads + 2 * kv_heads, HEAD_DIM, generator=gen)
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM)
    caches = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return (qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], caches,
            meta)


@settings(max_examples=30, deadline=None)
@given(decode_lens=st.lists(st.integers(1, 300), max_size=3),
       chunks=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 200)), min_size=1,
                       max_size=4),
       kv_heads=st.sampled_from([1, 3]), groups=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_a_steps_chunks_in_one_call_match_the_reference(decode_lens, chunks, kv_heads, groups,
                                                        seed):
    # A mixed step through the backend: the kernel takes every chunk in one call, its work
    # items across requests. It equals the reference step, and bit for bit the kernel run on
    # each chunk alone (a row's arithmetic does not depend on which item holds it).
    gen = torch.Generator().manual_seed(seed)
    query, key, value, caches, meta = random_mixed_step(gen, decode_lens, chunks, kv_heads,
                                                        groups)
    heads, scale = kv_heads * groups, HEAD_DIM ** -0.5
    reference, paged = (cls(heads, kv_heads, HEAD_DIM, scale)
                        for cls in (TorchReferenceBackend, CpuPagedBackend))
    expected = reference.forward(query, key, value, tuple(c.clone() for c in caches), meta)
    got = paged.forward(query, key, value, caches, meta)
    assert (got - expected).abs().max().item() < 1e-4
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        alone = torch.empty_like(query[rows])
        assert call_prefill(load_kernel(), alone, query[rows], caches, span.block_table,
                            span.seq_len, scale)
        assert torch.equal(got[rows].view_as(alone), alone)


def test_prefill_kernel_output_is_the_same_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(5)
    query, _, _, caches, span = random_prefill(gen, 333, 200, 3, 3, BLOCK_SIZE, HEAD_DIM)
    kernel, before = load_kernel(), torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty_like(query)
            assert call_prefill(kernel, out, query, caches, span.block_table, span.seq_len,
                                HEAD_DIM ** -0.5)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])



def test_outputs_do_not_depend_on_what_earlier_calls_left_in_the_kept_scratch():
    # Each thread keeps its scratch from call to call. Larger calls over NaN caches between two
    # runs of small ones fill it with NaNs past what the small ones use: an element read before
    # it is written would show in the second run.
    kernel, scale = load_kernel(), HEAD_DIM ** -0.5
    gen = torch.Generator().manual_seed(11)

    def small_calls():
        gen.manual_seed(11)
        query, _, _, caches, span = random_prefill(gen, 40, 7, 3, 3, BLOCK_SIZE, HEAD_DIM)
        prefill = torch.empty_like(query)
        assert call_prefill(kernel, prefill, query, caches, span.block_table, span.seq_len,
                            scale)
        seq_lens = [70, 5]
        decode = run_decode(CpuPagedBackend(9, 3, HEAD_DIM, scale), query[:2], caches,
                            metadata(random_decode_batch(gen, seq_lens, 0), seq_lens, None))
        return prefill, decode

    first = small_calls()
    query, _, _, caches, span = random_prefill(gen, 600, 300, 3, 5, BLOCK_SIZE, HEAD_DIM)
    for cache in caches:
        cache.fill_(float("nan"))
    call_prefill(kernel, torch.empty_like(query), query, caches, span.block_table,
                 span.seq_len, scale)
    seq_lens = [900, 700, 30, 50, 60, 70, 80, 90]   # a slice each: in the kept scratch
    run_decode(CpuPagedBackend(15, 3, HEAD_DIM, scale), query[:8], caches,
               metadata(random_decode_batch(gen, seq_lens, 0), seq_lens, None))
    second = small_calls()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not any(t.isnan().any() for t in second)



@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 70), kv_heads=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_cache_writes_equal_index_copys_bitwise(tokens, kv_heads, seed):
    # The backend's C++ row copies leave the caches bitwise as the reference's index_copy_
    # does, for keys and values that are views into a wider qkv projection.
    gen = torch.Generator().manual_seed(seed)
    heads = 3 * kv_heads
    qkv = torch.randn(tokens, heads + 2 * kv_heads, HEAD_DIM, generator=gen)
    key, value = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM)
    expected = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    got = tuple(c.clone() for c in expected)
    write_kv(key, value, *expected, slots)
    CpuPagedBackend(heads, kv_heads, HEAD_DIM, 1.0)._write_kv(key, value, *got, slots)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_cache_writes_reject_a_slot_out_of_range_and_write_nothing():
    shape = (4, BLOCK_SIZE, 3, HEAD_DIM)
    caches = (torch.zeros(shape), torch.zeros(shape))
    rows = torch.ones(2, 3, HEAD_DIM)
    with pytest.raises(RuntimeError, match="slot out of range"):
        load_kernel().write_kv_slots(rows, rows, *caches, torch.tensor([1, 4 * BLOCK_SIZE]))
    assert not any(c.any() for c in caches)

AVX512_TILES = load_kernel() is not None and load_kernel().paged_attention_has_avx512()


@pytest.mark.skipif(not AVX512_TILES, reason="the kernel was built without AVX-512 here")
@settings(max_examples=25, deadline=None)
@given(cached=st.integers(0, 400), query_len=st.integers(1, 120),
       groups=st.sampled_from([1, 3, 5]), block_size=st.sampled_from([8, 16, 32]),
       head_dim=st.sampled_from([40, 64, 128]), members=st.sampled_from([3, 17]),
       seed=st.integers(0, 2**16))
def test_avx512_tiles_give_bitwise_the_avx2_tiles_output(cached, query_len, groups, block_size,
                                                         head_dim, members, seed):
    # The AVX-512 tiles (12 rows x 16 keys, 6 rows x 64 dims) and the 16-lane values step of a
    # single decode make the same FMAs in the same order as the AVX2 ones, and rows in 16 lanes
    # the same operations per row as in 8, so prefill chunks, shared-prefix decodes (3 or 17 of
    # them: 3-85 rows, row tiles or passes of lanes) and a lone decode come out bit for bit the
    # same on either.
    gen = torch.Generator().manual_seed(seed)
    query, _, _, caches, span = random_prefill(gen, cached, query_len, 2, groups, block_size,
                                               head_dim)
    kernel, scale = load_kernel(), head_dim ** -0.5
    shared = (span.seq_len - 1) // block_size   # the context's full blocks, as the prefix
    decodes = (span.block_table[:shared + 1].repeat(members, 1),
               torch.tensor([shared * block_size + 1] * members),
               torch.randn(members, *query.shape[1:], generator=gen))

    lone = torch.randn(1, *query.shape[1:], generator=gen)   # the per-request route

    def run() -> list[torch.Tensor]:
        prefill_out, decode_out = torch.empty_like(query), torch.empty_like(decodes[2])
        lone_out = torch.empty_like(lone)
        assert call_prefill(kernel, prefill_out, query, caches, span.block_table, span.seq_len,
                            scale)
        table, lens, decode_query = decodes
        kernel.paged_decode_attention(decode_out, decode_query, *caches, table, lens, scale, -1)
        kernel.paged_decode_attention(lone_out, lone, *caches, span.block_table[None],
                                      torch.tensor([span.seq_len]), scale, -1)
        return [prefill_out, decode_out, lone_out]

    wide = run()
    with avx2_tiles(kernel.paged_attention_use_avx512):
        narrow = run()
    assert all(torch.equal(w, n) for w, n in zip(wide, narrow))


def test_prefill_kernel_leaves_shapes_it_does_not_take_to_the_reference():
    gen = torch.Generator().manual_seed(6)
    query, key, value, caches, span = random_prefill(gen, 20, 9, 2, 2, BLOCK_SIZE, 36)
    out = torch.full_like(query, 7.0)
    assert not call_prefill(load_kernel(), out, query, caches, span.block_table, span.seq_len,
                            0.1)   # head_dim 36
    assert torch.equal(out, torch.full_like(query, 7.0))
    expected = run_prefill(TorchReferenceBackend(4, 2, 36, 0.1), query, key, value, caches, span)
    got = run_prefill(CpuPagedBackend(4, 2, 36, 0.1), query, key, value, caches, span)
    assert torch.equal(got, expected)


def test_long_uncached_chunks_take_the_faster_path():
    # SDPA's flash kernel beat the paged kernel's AVX2 tiles on long uncached prompts, not its
    # AVX-512 ones: the backend routes them by what the kernel was built with.
    from tokenmill.attention.cpu_paged import SDPA_MIN_UNCACHED
    gen = torch.Generator().manual_seed(9)
    args = random_prefill(gen, 0, SDPA_MIN_UNCACHED, 1, 3, BLOCK_SIZE, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    expected = run_prefill(TorchReferenceBackend(3, 1, HEAD_DIM, scale), *args)
    backend, kernel = CpuPagedBackend(3, 1, HEAD_DIM, scale), load_kernel()
    got = run_prefill(backend, *args)
    if kernel.paged_attention_has_avx512():
        assert backend.sdpa_from is None
        query, _, _, caches, span = args
        direct = torch.empty_like(query)
        assert call_prefill(kernel, direct, query, caches, span.block_table, span.seq_len, scale)
        assert torch.equal(got, direct)
        assert (got - expected).abs().max().item() < 1e-4
    else:
        assert backend.sdpa_from == SDPA_MIN_UNCACHED
        assert torch.equal(got, expected)


def test_prefill_kernel_rejects_bad_spans():
    gen = torch.Generator().manual_seed(8)
    query, _, _, caches, span = random_prefill(gen, 40, 8, 1, 3, BLOCK_SIZE, HEAD_DIM)
    kernel, out = load_kernel(), torch.empty_like(query)
    bad = span.block_table.clone()
    bad[1] = NUM_BLOCKS
    with pytest.raises(RuntimeError, match="block id out of range"):
        call_prefill(kernel, out, query, caches, bad, span.seq_len, 1.0)
    with pytest.raises(RuntimeError, match="seq_len must cover the query"):
        call_prefill(kernel, out, query, caches, span.block_table, 7, 1.0)
    with pytest.raises(RuntimeError, match="seq_len must cover the query"):
        call_prefill(kernel, out, query, caches, span.block_table[:2], 48, 1.0)


PREFIX = ("You are a careful assistant for a railway company. Answer questions about timetables, "
          "tickets, refunds and accessibility. Be short and exact. ") * 4
PROMPTS = [PREFIX + q for q in ("When is the first train?", "Refund?", "Bikes allowed on board "
           "during rush hour on weekdays?", "Hi")] + [
    "Tell me a story about a lighthouse.", "2+2=", "Write a haiku about autumn rain in a city "
    "at night, with neon lights.", "List three colors."]


def test_greedy_tokens_equal_reference_backend(make_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for name in ("torch", "cpu_paged"):
        llm = make_llm(attention_backend=name)
        layer = llm.engine.core.worker.runner.model.model.layers[0]
        assert layer.self_attn.backend.name == name
        outputs[name] = llm.generate(PROMPTS, params)
    assert ([o.outputs[0].token_ids for o in outputs["cpu_paged"]]
            == [o.outputs[0].token_ids for o in outputs["torch"]])
    assert sum(o.num_cached_tokens > 0 for o in outputs["cpu_paged"]) >= 3  # prefix hits


def test_auto_picks_the_kernel_for_cpu_float32_only():
    from tokenmill.attention.registry import resolve_backend_name
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu, torch.float32) == "cpu_paged"
    assert resolve_backend_name("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_backend_name("torch", cpu, torch.float32) == "torch"


def test_without_a_compiler_auto_falls_back_to_reference(monkeypatch, caplog):
    import tokenmill.attention.cpu_paged as cpu_paged
    from torch.utils import cpp_extension
    from tokenmill.attention.registry import resolve_backend_name

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    monkeypatch.setattr(cpu_paged.KERNEL, "_module", None)   # restored after the test
    monkeypatch.setattr(cpu_paged.KERNEL, "_tried", False)
    with caplog.at_level("WARNING"):
        assert resolve_backend_name("auto", torch.device("cpu"), torch.float32) == "torch"
    assert "cpu_paged attention kernel unavailable" in caplog.text
    backend = CpuPagedBackend(3, 1, HEAD_DIM, HEAD_DIM ** -0.5)   # still works, on the reference
    assert backend.kernel is None
