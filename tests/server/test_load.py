"""Concurrency, disconnects and liveness under load, against a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL

PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]


def _chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 12, **extra}


async def _stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, str | None]:
    text, reason = "", None
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason


def test_32_concurrent_streams_match_single_greedy(server, http):
    expected = {p: http.post("/v1/chat/completions", json=_chat(p)).json()
                ["choices"][0]["message"]["content"] for p in PROMPTS}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            bodies = [_chat(PROMPTS[i % len(PROMPTS)]) for i in range(32)]
            return await asyncio.gather(*(_stream_text(client, b) for b in bodies))

    results = asyncio.run(run())
    for i, (text, reason) in enumerate(results):
        assert text == expected[PROMPTS[i % len(PROMPTS)]], i
        assert reason in ("stop", "length")
    assert server.wait_idle()["tokenmill:kv_cache_usage_perc"] == 0


def test_health_and_metrics_answer_while_busy(server):
    """Not a speed assertion: /health must keep answering 200 while a batch runs."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            bodies = [_chat(f"Tell a long story {i}", max_tokens=48, ignore_eos=True)
                      for i in range(16)]
            work = asyncio.gather(*(_stream_text(client, b) for b in bodies))
            task = asyncio.ensure_future(work)
            latencies, running = [], 0.0
            while not task.done():
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - start)
                metrics = (await client.get("/metrics")).text
                running = max(running, _value(metrics, "tokenmill:num_requests_running"))
                await asyncio.sleep(0.05)
            await task
            return latencies, running

    latencies, running = asyncio.run(run())
    latencies.sort()
    print(f"/health under load: n={len(latencies)} median={latencies[len(latencies) // 2]:.4f}s "
          f"max={latencies[-1]:.4f}s")
    assert running > 1 and len(latencies) > 3
    after = server.wait_idle()
    assert after["tokenmill:generation_tokens_total"] >= 16 * 48
    assert after["tokenmill:e2e_request_latency_seconds_count"] >= 16


def _value(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_disconnect_mid_stream_frees_blocks(server):
    body = _chat("Count to one thousand.", max_tokens=1000, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(8)) if line.startswith("data:")]
            assert len(received) >= 3
            assert server.metrics()["tokenmill:num_requests_running"] == 1
    metrics = server.wait_idle()
    assert metrics["tokenmill:num_requests_running"] == 0
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


def test_disconnect_before_first_token_frees_blocks(server):
    long_prompt = "A very long prompt about many things. " * 150  # several prefill steps
    body = _chat(long_prompt, max_tokens=500, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200  # headers (and the role chunk) only
    metrics = server.wait_idle()
    assert metrics["tokenmill:num_requests_running"] == 0
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


def test_disconnect_non_streaming_aborts(server):
    body = _chat("Count to one thousand.", max_tokens=1000, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=1.5) as client:
        try:
            client.post("/v1/chat/completions", json=body)
        except httpx.TimeoutException:
            pass
    metrics = server.wait_idle(timeout=10)
    assert metrics["tokenmill:num_requests_running"] == 0
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


def _step_figures(server) -> dict[str, float]:
    """The engine-step histograms' counts and sums, labelled series kept apart."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    figures = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("tokenmill:iteration_tokens_total_",
                                       "tokenmill:step_duration_seconds_")) and \
                    sample.name.endswith(("_count", "_sum")):
                figures[f"{sample.name}/{sample.labels.get('kind', '')}"] = sample.value
    return figures


def test_step_metrics_count_every_step_and_token(server, http):
    """Alone on the server, a request's prompt is one step with prompt work and each token
    after the first one decode step; the steps' tokens add up to the prompt's uncached tokens
    and every generated token but the last (which no step computes)."""
    server.wait_idle()
    before = _step_figures(server)
    body = {**_chat(f"Name a colour, then a fruit ({time.time_ns()})."), "max_tokens": 9,
            "ignore_eos": True}
    usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    server.wait_idle()
    after = _step_figures(server)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert usage["completion_tokens"] == 9
    assert delta["tokenmill:step_duration_seconds_count/prefill"] == 1
    assert delta["tokenmill:step_duration_seconds_count/decode"] == 8
    assert delta["tokenmill:iteration_tokens_total_count/"] == 9
    assert delta["tokenmill:iteration_tokens_total_sum/"] == uncached + 8
    assert 0 < delta["tokenmill:step_duration_seconds_sum/decode"] < 8 * 1.0
