"""AsyncLLM.build: the engine is built on the thread that later steps it, build errors reach the
caller, and shutting down before start does not hang. A stand-in engine records which thread
touched it; the real engine behind a server is covered by tests/server."""

from __future__ import annotations

import threading

import pytest

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.metrics.stats import SchedulerStats


class ThreadRecordingEngine:
    """Only what AsyncLLM's loop calls while no request is queued."""

    def __init__(self) -> None:
        self.threads = {"built": threading.current_thread().name}
        self.polled = threading.Event()

    def has_unfinished_requests(self) -> bool:
        self.threads["polled"] = threading.current_thread().name
        self.polled.set()
        return False

    def stats(self) -> SchedulerStats:
        return SchedulerStats()


def test_engine_is_built_and_stepped_on_one_thread():
    llm = AsyncLLM.build(ThreadRecordingEngine)
    try:
        assert llm.engine.threads["built"] == "tokenmill-engine"
        assert not llm.engine.polled.wait(0.2), "the loop must wait for start()"
        llm.start()
        assert llm.engine.polled.wait(5)
        assert llm.engine.threads["polled"] == "tokenmill-engine"
        assert llm.is_healthy()
    finally:
        llm.shutdown()
    assert not llm._thread.is_alive()


def test_build_error_reaches_the_caller():
    def broken() -> ThreadRecordingEngine:
        raise ValueError("model: unknown architecture 'Foo'")

    with pytest.raises(ValueError, match="unknown architecture"):
        AsyncLLM.build(broken)


def test_shutdown_before_start_ends_the_thread():
    llm = AsyncLLM.build(ThreadRecordingEngine)
    llm.shutdown()
    assert not llm._thread.is_alive()
    assert not llm.engine.polled.is_set()
