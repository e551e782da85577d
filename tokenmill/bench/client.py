"""Streaming OpenAI-compatible requests over httpx, timing every content chunk.

SSE is parsed here (not by an SDK) so the timestamps are taken the moment each event's
line arrives. Any server misbehaviour (status, dropped connection, garbage, an error event)
becomes `record.error`; nothing here raises for it.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import httpx

from tokenmill.bench.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def make_http_client(timeout_s: float) -> httpx.AsyncClient:
    # trust_env=False: never route 127.0.0.1 benchmarks through a proxy from the environment.
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))


def request_body(endpoint: str, model: str, prompt: str | None, messages: list[dict] | None,
                 output_len: int, temperature: float, exact_len: bool = True) -> dict:
    """Fixed-length output: max_tokens + min_tokens + ignore_eos (servers ignore unknowns);
    with exact_len False, max_tokens only."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": output_len, "temperature": temperature}
    if exact_len:
        body.update(min_tokens=output_len, ignore_eos=True)
    if endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(event: dict, endpoint: str) -> tuple[str, bool]:
    """(text, finished) of one streamed event."""
    text, finished = "", False
    for choice in event.get("choices") or []:
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
        finished = finished or choice.get("finish_reason") is not None
    return text, finished


def _take_usage(event: dict, record: RequestRecord) -> None:
    usage = event.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        record.output_tokens = int(usage["completion_tokens"])
        record.prompt_tokens = usage.get("prompt_tokens")
        record.usage_reported = True


def _on_event(payload: str, endpoint: str, record: RequestRecord,
              on_first_token: Callable[[], None] | None) -> bool:
    """Handle one `data:` payload; True when the server marked the stream finished."""
    event = json.loads(payload)
    if not isinstance(event, dict):
        raise ValueError(f"unexpected event {payload[:100]!r}")
    if "error" in event:
        raise ValueError(f"server error event: {json.dumps(event['error'])[:200]}")
    text, finished = _chunk_text(event, endpoint)
    if text:
        now = time.perf_counter()
        if record.first_token is None:
            record.first_token = now
            if on_first_token:
                on_first_token()
        record.chunk_times.append(now)
        record.text += text
    _take_usage(event, record)
    return finished


async def _read_stream(response: httpx.Response, endpoint: str, record: RequestRecord,
                       on_first_token: Callable[[], None] | None) -> None:
    done = finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, other SSE fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        finished = _on_event(payload, endpoint, record, on_first_token) or finished
    if not (done or finished):
        raise ValueError("the stream ended before the response was finished")
    if not record.usage_reported:
        record.output_tokens = len(record.chunk_times)  # best effort: one token per chunk


async def stream_request(http: httpx.AsyncClient, base_url: str, endpoint: str, body: dict,
                         record: RequestRecord,
                         on_first_token: Callable[[], None] | None = None) -> None:
    """Send one streaming request and fill `record`; failures land in `record.error`."""
    record.start = time.perf_counter()
    try:
        async with http.stream("POST", base_url.rstrip("/") + ENDPOINTS[endpoint],
                               json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {detail[:200]}"
                return
            await _read_stream(response, endpoint, record, on_first_token)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.end = time.perf_counter()


async def served_model(http: httpx.AsyncClient, base_url: str) -> str:
    """The first model id in GET /v1/models (used when --model is not given)."""
    response = await http.get(base_url.rstrip("/") + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]
