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
        self.model_name = model_name
        self._tracks: dict[str, _RequestTrack] = {}
        for metric in (*self._gauges.values(), *self._totals.values(), self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time):
            metric.labels(model_name)  # export every series from the start, at zero

    def record(self, stats: SchedulerStats, outputs: list[RequestOutput]) -> None:
        name = self.model_name
        for key, gauge in self._gauges.items():
            gauge.labels(name).set(getattr(stats, key))
        for key, counter in self._totals.items():
            total = getattr(stats, key)
            if total > self._last_totals[key]:
                counter.labels(name).inc(total - self._last_totals[key])
            self._last_totals[key] = total
        now = time.monotonic()
        for output in outputs:
            self._record_request(output, now)

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
