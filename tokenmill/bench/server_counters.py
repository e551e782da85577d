"""A server's own counters around a benchmark run: its prefix cache, its draft tokens and (for
tokenmill) its engine steps.

A server keeps its prefix cache between runs, so a workload whose prompts it has already seen
(the same seed run twice, or an ad-hoc check before a set) is answered partly from the cache
and measures that, not the engine. With speculative decoding, how many drafts the server kept
explains its speed (and depends on the text as much as on the engine). tokenmill and vLLM
both count these in their Prometheus metrics (`<namespace>:prefix_cache_{queries,hits}`,
`<namespace>:spec_decode_num_{draft,accepted}_tokens`); reading them before and after the run
gives the run's share. Servers without them (llama-server) give None. tokenmill also times
every engine step (`tokenmill:step_duration_seconds`, by kind: `decode` steps without prompt
work, `prefill` steps with some): the run's steps of each kind and their mean time show where a
run's time went without a profiler.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics import prometheus


@dataclass(frozen=True)
class CounterPair:
    """Two counters of a server: a total, and the part of it that succeeded."""
    total: str                    # sample name after the namespace
    part: str
    keys: tuple[str, str, str]    # the results line's names for total, part and their ratio


PREFIX_CACHE = CounterPair("prefix_cache_queries_total", "prefix_cache_hits_total",
                           ("queries", "hits", "hit_rate"))
SPEC_DECODE = CounterPair("spec_decode_num_draft_tokens_total",
                          "spec_decode_num_accepted_tokens_total",
                          ("drafts", "accepted", "acceptance_rate"))
PAIRS = (PREFIX_CACHE, SPEC_DECODE)

@dataclass(frozen=True)
class StepKind:
    """tokenmill's engine steps of one kind: their count and total seconds."""
    kind: str


STEP_KINDS = tuple(StepKind(kind) for kind in prometheus.STEP_KINDS)
_STEP_SECONDS = prometheus.STEP_SECONDS

# pair -> (total, part); step kind -> (steps, seconds)
Readings = dict[CounterPair | StepKind, tuple[float, float]]


def parse_counters(text: str) -> Readings:
    """Each pair whose two counters a Prometheus text page has, summed over label sets, and
    each kind of tokenmill's engine steps."""
    totals: dict[str, float] = {}
    wanted = {name for pair in PAIRS for name in (pair.total, pair.part)}
    steps: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # the name after the namespace, exactly: vLLM also counts an external KV
            # connector's cache as `vllm:external_prefix_cache_*`
            name = sample.name.rsplit(":", 1)[-1]
            if name in wanted:
                totals[name] = totals.get(name, 0.0) + sample.value
            elif sample.name in (_STEP_SECONDS + "_count", _STEP_SECONDS + "_sum"):
                key = (sample.labels.get("kind", ""), sample.name.rsplit("_", 1)[-1])
                steps[key] = steps.get(key, 0.0) + sample.value
    readings: Readings = {pair: (totals[pair.total], totals[pair.part]) for pair in PAIRS
                          if pair.total in totals and pair.part in totals}
    for step in STEP_KINDS:
        if (step.kind, "count") in steps and (step.kind, "sum") in steps:
            readings[step] = (steps[step.kind, "count"], steps[step.kind, "sum"])
    return readings


async def read_counters(http: httpx.AsyncClient, base_url: str) -> Readings:
    """GET {base_url}/metrics and parse it; empty if the server has no such page."""
    try:
        response = await http.get(f"{base_url.rstrip('/')}/metrics")
        if response.status_code != 200:
            return {}
        return parse_counters(response.text)
    except (httpx.HTTPError, OSError, ValueError):
        return {}


def run_share(pair: CounterPair, before: Readings, after: Readings) -> dict | None:
    """The run's increase of the pair's total and part and the part's share of it (None
    without both readings, or when the total did not grow)."""
    if pair not in before or pair not in after:
        return None
    total = after[pair][0] - before[pair][0]
    part = after[pair][1] - before[pair][1]
    if total <= 0:
        return None
    total_key, part_key, ratio_key = pair.keys
    return {total_key: int(total), part_key: int(part), ratio_key: part / total}


def step_share(before: Readings, after: Readings) -> dict | None:
    """The run's engine steps of each kind that ran any: {kind: {"steps", "mean_ms"}} (None
    without both readings or without steps)."""
    share = {}
    for step in STEP_KINDS:
        if step in before and step in after:
            count = after[step][0] - before[step][0]
            if count > 0:
                seconds = after[step][1] - before[step][1]
                share[step.kind] = {"steps": int(count), "mean_ms": 1000 * seconds / count}
    return share or None
