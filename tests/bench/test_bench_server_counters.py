"""Reading a server's prefix-cache and draft counters from its Prometheus page (pure, fast)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tokenmill.bench.server_counters import (PREFIX_CACHE, SPEC_DECODE, CounterPair,
                                             parse_counters, run_share)

COUNTS = st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**9)), min_size=1,
                  max_size=4)
NAMES = {PREFIX_CACHE: ("prefix_cache_queries", "prefix_cache_hits"),
         SPEC_DECODE: ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}


def _page(namespace: str, counts: dict[CounterPair, list[tuple[int, int]]],
          extra: bool = False) -> str:
    """A real registry's exposition: each pair's two counters, one label set per (total,
    part)."""
    registry = CollectorRegistry()
    for pair, per_label in counts.items():
        total_name, part_name = NAMES[pair]
        total = Counter(f"{namespace}:{total_name}", "total", ["model"], registry=registry)
        part = Counter(f"{namespace}:{part_name}", "part", ["model"], registry=registry)
        for i, (t, p) in enumerate(per_label):
            total.labels(model=f"m{i}").inc(t)
            part.labels(model=f"m{i}").inc(p)
    if extra:   # vLLM's external KV-connector counters must not be added in
        Counter(f"{namespace}:external_prefix_cache_queries", "x", registry=registry).inc(7)
        Counter(f"{namespace}:external_prefix_cache_hits", "x", registry=registry).inc(5)
    return generate_latest(registry).decode()


@settings(max_examples=40, deadline=None)
@given(namespace=st.sampled_from(["tokenmill", "vllm"]),
       counts=st.dictionaries(st.sampled_from([PREFIX_CACHE, SPEC_DECODE]), COUNTS),
       extra=st.booleans())
def test_counters_are_summed_over_label_sets(namespace, counts, extra):
    readings = parse_counters(_page(namespace, counts, extra))
    assert readings == {pair: (sum(t for t, _ in per_label), sum(p for _, p in per_label))
                        for pair, per_label in counts.items()}


def test_a_page_without_the_counters_gives_nothing():
    registry = CollectorRegistry()
    Counter("llamacpp:prompt_tokens", "x", registry=registry).inc(3)
    Counter("tokenmill:prefix_cache_queries", "one of two", registry=registry).inc(3)
    assert parse_counters(generate_latest(registry).decode()) == {}
    assert parse_counters("") == {}


@given(pair=st.sampled_from([PREFIX_CACHE, SPEC_DECODE]),
       before=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
       more=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
def test_a_run_share_is_the_difference_of_two_readings(pair, before, more):
    t0, p0 = before
    dt, dp = more
    dp = min(dp, dt)   # a server never finds (or keeps) more than it looked up (or checked)
    share = run_share(pair, {pair: (t0, p0)}, {pair: (t0 + dt, p0 + dp)})
    total_key, part_key, ratio_key = pair.keys
    if dt == 0:
        assert share is None
    else:
        assert share[total_key] == dt and share[part_key] == dp
        assert share[ratio_key] == pytest.approx(dp / dt)
    assert run_share(pair, {}, {pair: (t0, p0)}) is None
    assert run_share(pair, {pair: (t0, p0)}, {}) is None
