"""Reading a server's prefix-cache counters from its Prometheus page (pure, fast)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tokenmill.bench.server_cache import CacheCounters, cache_share, parse_counters

COUNTS = st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**9)), min_size=1,
                  max_size=4)


def _page(namespace: str, per_label: list[tuple[int, int]], extra: bool = False) -> str:
    """A real registry's exposition: the two counters, one label set per (queries, hits)."""
    registry = CollectorRegistry()
    queries = Counter(f"{namespace}:prefix_cache_queries", "looked up", ["model"],
                      registry=registry)
    hits = Counter(f"{namespace}:prefix_cache_hits", "found", ["model"], registry=registry)
    if extra:   # vLLM's external KV-connector counters must not be added in
        Counter(f"{namespace}:external_prefix_cache_queries", "x", registry=registry).inc(7)
        Counter(f"{namespace}:external_prefix_cache_hits", "x", registry=registry).inc(5)
    for i, (q, h) in enumerate(per_label):
        queries.labels(model=f"m{i}").inc(q)
        hits.labels(model=f"m{i}").inc(h)
    return generate_latest(registry).decode()


@settings(max_examples=40, deadline=None)
@given(namespace=st.sampled_from(["tokenmill", "vllm"]), per_label=COUNTS, extra=st.booleans())
def test_counters_are_summed_over_label_sets(namespace, per_label, extra):
    counters = parse_counters(_page(namespace, per_label, extra))
    assert counters == CacheCounters(sum(q for q, _ in per_label), sum(h for _, h in per_label))


def test_a_page_without_the_counters_gives_none():
    registry = CollectorRegistry()
    Counter("llamacpp:prompt_tokens", "x", registry=registry).inc(3)
    assert parse_counters(generate_latest(registry).decode()) is None
    assert parse_counters("") is None


@given(before=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
       more=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
def test_cache_share_is_the_difference_of_two_readings(before, more):
    q0, h0 = before
    dq, dh = more
    dh = min(dh, dq)   # a server never finds more tokens than it looked up
    share = cache_share(CacheCounters(q0, h0), CacheCounters(q0 + dq, h0 + dh))
    if dq == 0:
        assert share is None
    else:
        assert share["queries"] == dq and share["hits"] == dh
        assert share["hit_rate"] == pytest.approx(dh / dq)
    assert cache_share(None, CacheCounters(q0, h0)) is None
    assert cache_share(CacheCounters(q0, h0), None) is None
