"""Admission control, API key and SIGTERM draining, on a server with one running slot."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.server.conftest import MODEL, Server

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def small_server():
    srv = Server("--max-num-seqs", "1", "--max-num-waiting", "1", "--api-key", KEY)
    yield srv
    srv.stop()


def _long(**extra) -> dict:
    return {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
            "stream": True, **extra}


def _wait_for(small_server: Server, name: str, value: float, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while small_server.metrics()[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_api_key(small_server):
    with httpx.Client(base_url=small_server.url, timeout=60) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models").status_code == 401
        assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
    from openai import AuthenticationError, OpenAI
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=small_server.url + "/v1", api_key="wrong", max_retries=0
               ).models.list()
    good = OpenAI(base_url=small_server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL


def test_queue_bound_gives_429(small_server):
    with httpx.Client(base_url=small_server.url, timeout=60, headers=AUTH) as client:
        with client.stream("POST", "/v1/completions", json=_long()) as running:
            assert running.status_code == 200
            _wait_for(small_server, "tokenmill:num_requests_running", 1)
            with client.stream("POST", "/v1/completions", json=_long()) as waiting:
                assert waiting.status_code == 200
                _wait_for(small_server, "tokenmill:num_requests_waiting", 1)
                rejected = client.post("/v1/completions", json=_long(stream=False))
                assert rejected.status_code == 429
                assert int(rejected.headers["Retry-After"]) >= 1
                assert rejected.json()["error"]["message"]
    metrics = small_server.wait_idle()
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


def test_sigterm_drains_then_exits_zero(small_server):
    body = {**_long(), "max_tokens": 40, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=small_server.url, timeout=120, headers=AUTH) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[6:])["choices"]
            small_server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with httpx.Client(base_url=small_server.url, timeout=10) as fresh:
                assert fresh.get("/health").status_code == 503
                assert fresh.post("/v1/completions", json={"prompt": "x"},
                                  headers=AUTH).status_code == 503
            events = [json.loads(line[6:]) for line in lines
                      if line.startswith("data:") and line != "data: [DONE]"]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 40
    assert small_server.proc.wait(60) == 0
