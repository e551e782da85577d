"""`tokenmill bench serve`: drive a workload's plan against an OpenAI-compatible server.

Load comes from a concurrency limit (in-flight sessions) or from arrival times: Poisson at
--request-rate, or the recorded times of a trace. Warm-up requests run first and are not
counted; --max-duration stops new requests and cuts off the ones in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

from tokenmill.bench.client import make_http_client, request_body, served_model, stream_request
from tokenmill.bench.metrics import RequestRecord, request_detail, summarize
from tokenmill.bench.server_counters import (PREFIX_CACHE, SPEC_DECODE, read_counters,
                                              run_share, step_share)
from tokenmill.bench.utilization import Ceilings, ModelCost, utilization
from tokenmill.bench.workloads import (Plan, Session, TextTokenizer, Turn, WorkloadArgs,
                                       build_plan)


@dataclass
class BenchSettings:
    base_url: str
    workload: str
    model: str | None = None
    endpoint: str = "completions"
    label: str = "tokenmill"
    concurrency: int | None = None       # None: the workload's default (or none with a rate)
    request_rate: float | None = None    # sessions per second, Poisson arrivals
    warmup: int = 0
    max_duration: float | None = None
    temperature: float = 0.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 900.0
    sizes: WorkloadArgs = field(default_factory=WorkloadArgs)
    extra: dict = field(default_factory=dict)  # recorded with the result (e.g. a sweep id)
    requests_file: Path | None = None    # append one JSON line per measured request here
    ceilings: Ceilings | None = None     # the machine's peaks: the result gets `utilization`
    cost: ModelCost | None = None        # the served model's FLOPs and bytes per token
    weight_bytes: float | None = None    # weight bytes a lone stream reads a token (fp32)


class _Run:
    """One phase (warm-up or measured): sessions, their records, the first-token barrier."""

    def __init__(self, settings: BenchSettings, plan: Plan, model: str,
                 http: httpx.AsyncClient) -> None:
        self.settings, self.plan, self.model, self.http = settings, plan, model, http
        self.endpoint = "chat" if plan.chat_history else plan.endpoint or settings.endpoint
        self.records: list[RequestRecord] = []
        self.t0 = 0.0                      # perf_counter at the start of run()
        limit = effective_concurrency(settings, plan)
        self.limit = asyncio.Semaphore(limit) if limit else None
        # Sessions that wait start once all the others have a first token (or have ended).
        self.num_leaders = sum(1 for s in plan.sessions if not s.after_first_tokens)
        self.num_started = 0
        self.leaders_started = asyncio.Event()
        if self.num_leaders == 0:
            self.leaders_started.set()

    def _leader_started(self) -> None:
        self.num_started += 1
        if self.num_started >= self.num_leaders:
            self.leaders_started.set()

    def _body(self, session: Session, history: list[dict], turn: Turn) -> dict:
        if self.endpoint == "chat":
            system = [{"role": "system", "content": session.system}] if session.system else []
            messages = system + history + [{"role": "user", "content": turn.text}]
            return request_body("chat", self.model, None, messages, turn.output_len,
                                self.settings.temperature, turn.exact_len)
        return request_body("completions", self.model, (session.system or "") + turn.text,
                            None, turn.output_len, self.settings.temperature, turn.exact_len)

    async def _turns(self, session: Session, number: int) -> None:
        history: list[dict] = []
        signal = None if session.after_first_tokens else _once(self._leader_started)
        try:
            for index, turn in enumerate(session.turns):
                record = RequestRecord(session.group, turn.input_len, turn.output_len,
                                       exact_len=turn.exact_len, session=number, turn=index)
                self.records.append(record)
                body = self._body(session, history, turn)
                try:
                    await stream_request(self.http, self.settings.base_url, self.endpoint, body,
                                         record, signal)
                except asyncio.CancelledError:
                    record.cancelled = True
                    raise
                if record.error:
                    self._skip(session, number, index + 1)
                    return
                if self.plan.chat_history:
                    history += [{"role": "user", "content": turn.text},
                                {"role": "assistant", "content": record.text}]
        finally:
            if signal:
                signal()  # a stream that failed before its first token must not block others

    def _skip(self, session: Session, number: int, first: int) -> None:
        """Turns after a failed one are failures too: the conversation cannot go on."""
        for index, turn in enumerate(session.turns[first:], first):
            self.records.append(RequestRecord(session.group, turn.input_len, turn.output_len,
                                              error="skipped: an earlier turn failed",
                                              session=number, turn=index))

    async def session(self, session: Session, number: int, arrival: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + arrival - time.perf_counter()))
        if session.after_first_tokens:
            await self.leaders_started.wait()
        if self.limit is None:
            return await self._turns(session, number)
        async with self.limit:
            await self._turns(session, number)

    async def run(self, arrivals: list[float], max_duration: float | None) -> float:
        """Run every session; the wall time in seconds."""
        t0 = self.t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(self.session(s, number, a))
                 for number, (s, a) in enumerate(zip(self.plan.sessions, arrivals))]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max_duration)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return time.perf_counter() - t0


def _once(callback):
    called = False

    def fire() -> None:
        nonlocal called
        if not called:
            called = True
            callback()
    return fire


def effective_concurrency(settings: BenchSettings, plan: Plan) -> int | None:
    if settings.concurrency:
        return settings.concurrency
    return None if settings.request_rate or plan.workload == "trace" else plan.concurrency


def arrival_times(plan: Plan, request_rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each session may begin."""
    if any(s.arrival is not None for s in plan.sessions):
        return [s.arrival or 0.0 for s in plan.sessions]
    if not request_rate or request_rate == float("inf"):
        return [0.0] * len(plan.sessions)
    rng, now, times = random.Random(seed), 0.0, []
    for _ in plan.sessions:
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


# Warm-up texts come from a seed far from any measured run's: with seed + 1, a run's warm-up
# cached the next seed's shared_prefix system prompt, so that run measured a warm cache.
WARMUP_SEED_OFFSET = 1_000_003


def warmup_seed(seed: int) -> int:
    return seed + WARMUP_SEED_OFFSET


def warmup_plan(plan: Plan, num: int) -> Plan:
    """The first `num` requests of the plan as plain one-turn sessions, all at once."""
    sessions = [Session([s.turns[0]], system=s.system) for s in plan.sessions[:num]]
    return dataclasses.replace(plan, sessions=sessions, chat_history=False)


async def _bench(settings: BenchSettings, plan: Plan, warm: Plan | None) -> dict:
    async with make_http_client(settings.timeout_s) as http:
        try:
            model = settings.model or await served_model(http, settings.base_url)
        except (httpx.HTTPError, OSError, KeyError, IndexError, ValueError) as exc:
            raise RuntimeError(f"cannot list the models at {settings.base_url} ({exc}); "
                               "pass --model") from exc
        if warm and warm.sessions:
            await _Run(settings, warm, model, http).run([0.0] * len(warm.sessions), None)
        run = _Run(settings, plan, model, http)
        arrivals = arrival_times(plan, settings.request_rate, settings.sizes.seed)
        before = await read_counters(http, settings.base_url)   # after the warm-up
        duration = await run.run(arrivals, settings.max_duration)
        after = await read_counters(http, settings.base_url)
    result = result_line(settings, plan, model, run.endpoint, run.records, duration,
                         run_share(PREFIX_CACHE, before, after),
                         run_share(SPEC_DECODE, before, after), step_share(before, after))
    if settings.ceilings and settings.cost:
        result["utilization"] = utilization(result, run.records, settings.cost,
                                            settings.ceilings, settings.weight_bytes)
    if settings.requests_file:
        write_request_details(result, run.records, run.t0, settings.requests_file)
    return result


def write_request_details(result: dict, records: list[RequestRecord], t0: float,
                          path: Path) -> None:
    """Append one JSON line per request: the run's label, workload, seed and load, then the
    request's own figures (metrics.request_detail), in the order the requests were sent."""
    run = {"label": result["label"], "workload": result["workload"], "date": result["date"],
           **{k: result["settings"][k] for k in ("seed", "concurrency", "request_rate")}}
    unsent = float("inf")
    ordered = sorted(records, key=lambda r: (unsent if r.end is None else r.start,
                                             r.session, r.turn))
    with open(path, "a", encoding="utf-8") as out:
        for record in ordered:
            out.write(json.dumps({**run, **request_detail(record, t0)}) + "\n")


def result_line(settings: BenchSettings, plan: Plan, model: str, endpoint: str,
                records: list[RequestRecord], duration: float,
                server_prefix_cache: dict | None = None,
                server_spec_decode: dict | None = None,
                server_steps: dict | None = None) -> dict:
    figures = summarize(records, duration, settings.slo_ttft_ms, settings.slo_tpot_ms)
    return {
        "label": settings.label, "workload": plan.workload, "endpoint": endpoint,
        "base_url": settings.base_url, "model": model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "concurrency": effective_concurrency(settings, plan),
            "request_rate": settings.request_rate,
            "num_sessions": len(plan.sessions),
            "num_requests": sum(len(s.turns) for s in plan.sessions),
            "warmup": settings.warmup, "max_duration": settings.max_duration,
            "seed": settings.sizes.seed, "temperature": settings.temperature,
            "slo_ttft_ms": settings.slo_ttft_ms, "slo_tpot_ms": settings.slo_tpot_ms,
            **plan.settings, **settings.extra,
        },
        **figures,
        # prompt tokens the server's prefix cache served during the run (None: not reported)
        "server_prefix_cache": server_prefix_cache,
        # draft tokens the server checked and kept during the run (None: not reported)
        "server_spec_decode": server_spec_decode,
        # the server's engine steps during the run by kind, count and mean (None: not reported)
        "server_steps": server_steps,
    }


def run_bench(settings: BenchSettings, tokenizer: TextTokenizer) -> dict:
    """Build the plan (and warm-up), run it, and return the result line."""
    plan = build_plan(settings.workload, settings.sizes, tokenizer)
    return asyncio.run(_bench(settings, plan, build_warmup(settings, tokenizer)))


def build_warmup(settings: BenchSettings, tokenizer: TextTokenizer) -> Plan | None:
    """The warm-up requests (`settings.warmup` of them), from texts no measured run uses."""
    if not settings.warmup:
        return None
    sizes = dataclasses.replace(settings.sizes, seed=warmup_seed(settings.sizes.seed),
                                num_requests=settings.warmup)
    return warmup_plan(build_plan(settings.workload, sizes, tokenizer), settings.warmup)


def load_tokenizer(path: Path | None) -> TextTokenizer:
    """--tokenizer, or the tokenmill default model's tokenizer directory."""
    from tokenmill.bench.workloads import HFTextTokenizer
    if path is None:
        from tokenmill.config import DEFAULT_MODEL
        from tokenmill.models_hub import resolve
        path = resolve(DEFAULT_MODEL).tokenizer_dir
    return HFTextTokenizer(path)
