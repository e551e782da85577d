"""The server's own prefix-cache counters around a benchmark run.

A server keeps its prefix cache between runs, so a workload whose prompts it has already seen
(the same seed run twice, or an ad-hoc check before a set) is answered partly from the cache
and measures that, not the engine. tokenmill (`tokenmill:prefix_cache_{queries,hits}`) and
vLLM (`vllm:prefix_cache_{queries,hits}`) count prompt tokens looked up and found in their
Prometheus metrics; reading both counters before and after the run shows how much of it the
cache served. Servers without them (llama-server) give None.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_QUERIES, _HITS = "prefix_cache_queries_total", "prefix_cache_hits_total"


@dataclass(frozen=True)
class CacheCounters:
    queries: float   # prompt tokens looked up, since the server started
    hits: float      # of those, found in the cache


def parse_counters(text: str) -> CacheCounters | None:
    """The prefix-cache counters of a Prometheus text page (summed over label sets), or None
    unless it has both."""
    totals = {_QUERIES: 0.0, _HITS: 0.0}
    seen = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # the name after the namespace, exactly: vLLM also counts an external KV
            # connector's cache as `vllm:external_prefix_cache_*`
            name = sample.name.rsplit(":", 1)[-1]
            if name in totals:
                totals[name] += sample.value
                seen.add(name)
    if seen != set(totals):
        return None
    return CacheCounters(totals[_QUERIES], totals[_HITS])


async def read_counters(http: httpx.AsyncClient, base_url: str) -> CacheCounters | None:
    """GET {base_url}/metrics and parse it; None if the server has no such page or counters."""
    try:
        response = await http.get(f"{base_url.rstrip('/')}/metrics")
        if response.status_code != 200:
            return None
        return parse_counters(response.text)
    except (httpx.HTTPError, OSError, ValueError):
        return None


def cache_share(before: CacheCounters | None, after: CacheCounters | None) -> dict | None:
    """The run's prompt tokens looked up and found in the server's prefix cache, and the
    share found (None without both readings, or when nothing was looked up)."""
    if before is None or after is None:
        return None
    queries, hits = after.queries - before.queries, after.hits - before.hits
    if queries <= 0:
        return None
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries}
