"""Engine faults seen through a real server: a failed forward gives 500 to its requests only,
and a stuck engine turns /health to 503 until it moves again.

The server runs in-process (uvicorn on 127.0.0.1, the real default model) so the test can put
a fault into the worker; everything between the HTTP client and the worker is the real path.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerOptions, build_app

MODEL = "smollm2-135m-instruct"
STALL_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def served():
    import uvicorn
    config = EngineConfig.from_kwargs(model=MODEL, kv_cache_memory=0.1, max_model_len=512)
    async_llm = AsyncLLM.build(lambda: LLMEngine(config), stall_timeout=STALL_TIMEOUT)
    engine = async_llm.engine
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(async_llm, ServerOptions()),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(30)


def complete(url: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens,
            "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_failed_forward_is_500_for_its_request_only(served, monkeypatch):
    url, engine = served
    worker = engine.core.worker
    real_execute = worker.execute
    calls = []

    def fail_once(scheduled):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected worker fault")
        return real_execute(scheduled)

    monkeypatch.setattr(worker, "execute", fail_once)
    failed = complete(url)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert "injected worker fault" in error["message"] and error["type"]
    ok = complete(url)   # the engine keeps serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert httpx.get(url + "/health").status_code == 200
    engine.check_integrity()
    assert engine.kv_usage == 0.0


def test_stuck_engine_is_unhealthy_until_it_moves(served, monkeypatch):
    url, engine = served
    worker = engine.core.worker
    real_execute = worker.execute
    release = threading.Event()

    def hang(scheduled):
        release.wait(30)
        return real_execute(scheduled)

    monkeypatch.setattr(worker, "execute", hang)
    result: list[httpx.Response] = []
    client = threading.Thread(target=lambda: result.append(complete(url)))
    client.start()
    try:
        deadline = time.monotonic() + 10 * STALL_TIMEOUT
        while httpx.get(url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 while the engine hung"
            time.sleep(0.1)
    finally:
        release.set()
    client.join(60)
    assert result and result[0].status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    engine.check_integrity()
    assert engine.kv_usage == 0.0
