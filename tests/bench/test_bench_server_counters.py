"""Reading a server's prefix-cache and draft counters and its engine steps from its
Prometheus page (pure, fast)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tokenmill.bench.server_counters import (PREFIX_CACHE, SPEC_DECODE, STEP_KINDS,
                                             CounterPair, parse_counters, run_share, step_share)
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.metrics.stats import SchedulerStats

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


STEPS = st.lists(st.tuples(st.integers(1, 5_000), st.booleans(), st.floats(1e-4, 2.0)),
                 max_size=30)


def _logged(steps: list[tuple[int, bool, float]], logger: PrometheusStatLogger,
            done: int = 0) -> int:
    """Record each (tokens, with prompt work, seconds) as the engine thread does, a step at
    a time, with an idle record (no new step) in between; returns the steps counted."""
    for tokens, prompt, seconds in steps:
        done += 1
        stats = SchedulerStats(num_steps=done, last_step_tokens=tokens,
                               last_step_prompt_tokens=tokens if prompt else 0,
                               last_step_seconds=seconds)
        logger.record(stats, [])
        logger.record(stats, [])   # an idle loop round publishes the same stats again
    return done


@settings(max_examples=40, deadline=None)
@given(first=STEPS, run=STEPS)
def test_a_runs_steps_are_counted_by_kind_from_the_servers_own_page(first, run):
    """The real exporter's page: each step once (not again on idle records), by kind, and a
    run's share is the steps between two readings."""
    logger = PrometheusStatLogger("m")
    done = _logged(first, logger)
    before = parse_counters(generate_latest(logger.registry).decode())
    _logged(run, logger, done)
    after = parse_counters(generate_latest(logger.registry).decode())
    for step, prompt in zip(STEP_KINDS, (False, True)):
        mine = [seconds for _, p, seconds in first + run if p == prompt]
        assert after[step][0] == len(mine)
        assert after[step][1] == pytest.approx(sum(mine))
    share = step_share(before, after)
    for step, prompt in zip(STEP_KINDS, (False, True)):
        mine = [seconds for _, p, seconds in run if p == prompt]
        if not mine:
            assert share is None or step.kind not in share
            continue
        assert share[step.kind]["steps"] == len(mine)
        assert share[step.kind]["mean_ms"] == pytest.approx(1000 * sum(mine) / len(mine))
    page = generate_latest(logger.registry).decode()
    tokens = [t for t, _, _ in first + run]
    assert f'tokenmill:iteration_tokens_total_count{{model_name="m"}} {float(len(tokens))}' in page
    assert f'tokenmill:iteration_tokens_total_sum{{model_name="m"}} {float(sum(tokens))}' in page


def test_no_step_histogram_gives_no_steps():
    registry = CollectorRegistry()
    Counter("vllm:prefix_cache_queries", "x", registry=registry).inc(3)
    readings = parse_counters(generate_latest(registry).decode())
    assert step_share(readings, readings) is None and step_share({}, {}) is None
