"""AsyncLLM: the LLMEngine stepped in a background thread, driven from asyncio.

The engine thread owns the engine outright: asyncio code never touches it, it only posts
commands (add / abort) into a thread-safe queue. Outputs go back per request through
loop.call_soon_threadsafe into asyncio queues. torch and tokenmill's C++ kernels (layer loop
included, kernels/cpp_build.py) release the GIL, so the event loop answers HTTP and streams the
last step's tokens while the engine computes the next.

`AsyncLLM.build` also loads the model on that thread. Measured here: oneDNN's packed linears run
at about half speed on a thread other than the one that first ran OpenMP work in the process
(batch-1 decode 12 against 22 tok/s), so the thread that steps the engine must also be the one
that loads it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.processor import PromptInput
from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import FinishReason, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.host_memory import keep_freed_memory

logger = logging.getLogger(__name__)

_IDLE_WAIT = 0.5   # seconds the idle engine thread sleeps on its inbox (heartbeat period)


class StatLogger(Protocol):
    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None: ...


@dataclass
class _Add:
    request_id: str
    kwargs: dict[str, Any]
    sink: asyncio.Queue
    accepted: asyncio.Future
    loop: asyncio.AbstractEventLoop = field(repr=False)


@dataclass
class _Abort:
    request_id: str


class AsyncLLM:
    def __init__(self, engine: LLMEngine | None, stat_loggers: list[StatLogger] | None = None,
                 stall_timeout: float = 60.0) -> None:
        """engine: already built (its torch work then runs on two threads; see `build`)."""
        self.engine = engine
        self.stat_loggers = list(stat_loggers or [])
        self.stall_timeout = stall_timeout
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Add] = {}        # engine thread only
        self.stats = SchedulerStats()            # published by the engine thread
        self.num_in_flight = 0                   # requests accepted and not finished
        self.heartbeat = time.monotonic()        # last time the engine loop went round
        self._stop = threading.Event()
        self._started = threading.Event()
        self._factory: Callable[[], LLMEngine] | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="tokenmill-engine",
                                        daemon=True)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine], **kwargs: Any) -> AsyncLLM:
        """Build the engine on the engine thread (which then waits for `start`); re-raises
        whatever the factory raised."""
        keep_freed_memory()  # before the engine thread's first allocation picks its arena
        llm = cls(None, **kwargs)
        llm._factory = factory
        llm._thread.start()
        llm._built.wait()
        if llm._build_error is not None:
            raise llm._build_error
        return llm

    # ---- asyncio side --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()
        self.heartbeat = time.monotonic()
        self._started.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._started.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the engine's queue plus commands not yet picked up."""
        return self.stats.num_waiting + self._inbox.qsize()

    def is_healthy(self) -> bool:
        """Alive and making progress: the loop goes round at least every _IDLE_WAIT when idle
        and once per step when busy, so a stale heartbeat means a dead or hung engine."""
        return (self._thread.is_alive() and not self._stop.is_set()
                and time.monotonic() - self.heartbeat < self.stall_timeout)

    async def add_request(self, request_id: str, prompt: PromptInput | None,
                          params: SamplingParams, sink: asyncio.Queue, *,
                          messages: list[dict] | None = None, priority: int = 0,
                          cache_salt: str | None = None) -> None:
        """Queue a request; its RequestOutputs (cumulative snapshots) arrive on `sink`.
        Raises the engine's ValueError (naming the bad field) if it is rejected."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        kwargs = dict(prompt=prompt, params=params, messages=messages, priority=priority,
                      cache_salt=cache_salt)
        self._inbox.put(_Add(request_id, kwargs, sink, accepted, loop))
        await accepted

    def abort(self, request_id: str) -> None:
        """Safe from any thread; a no-op for finished or unknown requests."""
        self._inbox.put(_Abort(request_id))

    async def generate(self, request_id: str, prompt: PromptInput | None,
                       params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving the loop early aborts it."""
        sink: asyncio.Queue = asyncio.Queue()
        await self.add_request(request_id, prompt, params, sink, **kwargs)
        finished = False
        try:
            while not finished:
                output = await sink.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    # ---- engine thread -------------------------------------------------------------------

    def _thread_main(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as exc:  # handed to the building thread, which re-raises
                self._build_error = exc
                return
            finally:
                self._built.set()
        self._started.wait()
        self._run()

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            outputs = self._drain_inbox(block=not busy)
            if self.engine.has_unfinished_requests():
                outputs += self._step()
            self._publish(outputs)
            self.heartbeat = time.monotonic()
        self._publish(self._fail_all(FinishReason.ABORT, "the server is shutting down"))

    def _drain_inbox(self, block: bool) -> list[RequestOutput]:
        outputs = []
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT) if block else self._inbox.get_nowait()
            while command is not None:
                outputs += self._handle(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return outputs

    def _handle(self, command: _Add | _Abort) -> list[RequestOutput]:
        if isinstance(command, _Abort):
            if command.request_id not in self._sinks:
                return []
            output = self.engine.abort_request(command.request_id)
            return [output] if output else []
        try:
            self.engine.add_request(command.request_id, **command.kwargs)
        except Exception as exc:  # ValueError for bad input; anything else is still theirs
            command.loop.call_soon_threadsafe(_set_exception, command.accepted, exc)
            return []
        self._sinks[command.request_id] = command
        self.num_in_flight += 1
        command.loop.call_soon_threadsafe(_set_result, command.accepted)
        return []

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # a bug outside the forward pass: fail what is in flight
            logger.exception("engine loop failed")
            return self._fail_all(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")

    def _fail_all(self, reason: FinishReason, message: str) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self._sinks):
            output = self.engine.abort_request(request_id, reason, message)
            if output is not None:
                outputs.append(output)
        return outputs

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            add = self._sinks.get(output.request_id)
            if add is None:
                continue
            by_loop.setdefault(add.loop, []).append((add.sink, output))
            if output.finished:
                del self._sinks[output.request_id]
                self.num_in_flight -= 1
        for loop, items in by_loop.items():  # one wake-up per loop per step, not per request
            if not loop.is_closed():
                loop.call_soon_threadsafe(_deliver, items)
        self.stats = self.engine.stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self.stats, outputs)
            except Exception:  # metrics must never stop the engine
                logger.exception("stat logger failed")


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, output in items:
        sink.put_nowait(output)


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
