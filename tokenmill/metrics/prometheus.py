"""Prometheus exporter: SchedulerStats and per-request timings -> a CollectorRegistry.

Called by the engine thread after every loop iteration (prometheus-client is thread-safe).
Each app gets its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.metrics.stats import SchedulerStats
from tokenmill.outputs import FinishReason, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_KINDS = ("decode", "prefill")   # a step with no prompt work, and one with some
STEP_SECONDS = "tokenmill:step_duration_seconds"


class _RequestTrack:
    __slots__ = ("num_tokens", "last_time")

    def __init__(self) -> None:
        self.num_tokens = 0
        self.last_time: float | None = None


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self._gauges = {
            "num_running": Gauge("tokenmill:num_requests_running",
                                 "Requests running (in the batch)", **labels),
            "num_waiting": Gauge("tokenmill:num_requests_waiting",
                                 "Requests waiting to be scheduled", **labels),
            "kv_cache_usage": Gauge("tokenmill:kv_cache_usage_perc",
                                    "Fraction of KV blocks held by requests (0-1)", **labels),
            "spec_step_fixed_rows": Gauge("tokenmill:spec_decode_step_fixed_rows",
                                          "A decode step's fixed cost in rows' worth, as the "
                                          "draft policy weighs it (0 without drafts)", **labels),
        }
        # Counters that mirror running totals kept by the scheduler.
        self._totals = {
            "prefix_cache_queries": Counter("tokenmill:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache",
                                            **labels),
            "prefix_cache_hits": Counter("tokenmill:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache", **labels),
            "num_preemptions": Counter("tokenmill:num_preemptions",
                                       "Requests preempted", **labels),
            "spec_draft_tokens": Counter("tokenmill:spec_decode_num_draft_tokens",
                                         "Speculative draft tokens checked", **labels),
            "spec_accepted_tokens": Counter("tokenmill:spec_decode_num_accepted_tokens",
                                            "Speculative draft tokens accepted", **labels),
        }
        self._last_totals = dict.fromkeys(self._totals, 0)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed",
                                     **labels)
        self.generation_tokens = Counter("tokenmill:generation_tokens",
                                         "Tokens generated", **labels)
        self.request_success = Counter("tokenmill:request_success", "Requests finished",
                                       labelnames=["model_name", "finish_reason"],
                                       registry=self.registry)
        histogram = {**labels, "buckets": _LATENCY_BUCKETS}
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds",
                              "Arrival to first output token", **histogram)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds",
                             "Time between output tokens", **histogram)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds",
                             "Arrival to finish", **histogram)
        self.queue_time = Histogram("tokenmill:request_queue_time_seconds",
                                    "Arrival to first scheduled", **histogram)
        # Engine steps: how many tokens each computed and how long it took, by kind (with
        # prompt work or decodes only), for a step-by-step view of the batching.
        self.iteration_tokens = Histogram("tokenmill:iteration_tokens_total",
                                          "Tokens computed in an engine step",
                                          buckets=_TOKEN_BUCKETS, **labels)
        self.step_duration = Histogram(STEP_SECONDS,
                                       "An engine step, schedule to update, by kind: "
                                       "'prefill' with prompt work, 'decode' without",
                                       labelnames=["model_name", "kind"],
                                       registry=self.registry, buckets=_STEP_BUCKETS)
        self._last_steps = 0
        self.model_name = model_name
        self._tracks: dict[str, _RequestTrack] = {}
        for metric in (*self._gauges.values(), *self._totals.values(), self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time,
                       self.iteration_tokens):
            metric.labels(model_name)  # export every series from the start, at zero
        # the series' children, looked up once (a labels() call costs a few us a step)
        self._step_tokens = self.iteration_tokens.labels(model_name)
        self._step_seconds = {kind: self.step_duration.labels(model_name, kind)
                              for kind in STEP_KINDS}

    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        name = self.model_name
        for key, gauge in self._gauges.items():
            gauge.labels(name).set(getattr(stats, key))
        for key, counter in self._totals.items():
            total = getattr(stats, key)
            if total > self._last_totals[key]:
                counter.labels(name).inc(total - self._last_totals[key])
            self._last_totals[key] = total
        self._record_step(stats)
        now = time.monotonic()
        for output in outputs:
            self._record_request(output, now)

    def _record_step(self, stats: SchedulerStats) -> None:
        """The last engine step, if one ran since the previous record (the engine thread
        records after every step)."""
        if stats.num_steps <= self._last_steps:
            return
        self._last_steps = stats.num_steps
        self._step_tokens.observe(stats.last_step_tokens)
        kind = STEP_KINDS[1] if stats.last_step_prompt_tokens else STEP_KINDS[0]
        self._step_seconds[kind].observe(stats.last_step_seconds)

    def _record_request(self, output: RequestOutput, now: float) -> None:
        name = self.model_name
        track = self._tracks.setdefault(output.request_id, _RequestTrack())
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new = num_tokens - track.num_tokens
        if new > 0:
            if track.last_time is None:
                self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
            else:
                gap = (now - track.last_time) / new
                for _ in range(new):
                    self.itl.labels(name).observe(gap)
            self.generation_tokens.labels(name).inc(new)
            track.num_tokens, track.last_time = num_tokens, now
        if output.finished:
            del self._tracks[output.request_id]
            self._record_finished(output)

    def _record_finished(self, output: RequestOutput) -> None:
        name, metrics = self.model_name, output.metrics
        reason = output.outputs[0].finish_reason
        if reason != FinishReason.ERROR:
            self.request_success.labels(name, str(reason)).inc()
        if metrics.first_token_time is not None:
            self.ttft.labels(name).observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(
                metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.labels(name).observe(metrics.finished_time - metrics.arrival_time)
