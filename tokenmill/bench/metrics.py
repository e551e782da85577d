"""Benchmark figures from per-request timing records: pure functions, no I/O.

Times are seconds from `time.perf_counter()`; figures are reported in milliseconds.
TTFT = first content chunk - send; E2E = last byte - send; TPOT = (E2E - TTFT) / (tokens - 1)
per request; ITL = the gaps between consecutive content chunks, pooled over requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

QUANTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    group: str = "main"
    input_len: int = 0             # prompt tokens as built (usage replaces it when reported)
    output_len: int = 0            # output tokens asked for (at most, unless exact_len)
    exact_len: bool = True
    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content-bearing chunks only
    output_tokens: int = 0         # from usage, else the number of content chunks
    prompt_tokens: int | None = None  # from usage
    usage_reported: bool = False
    text: str = ""
    error: str | None = None
    cancelled: bool = False        # cut off by --max-duration: neither ok nor failed
    session: int = 0               # the plan's session (conversation) index
    turn: int = 0                  # the turn within it

    @property
    def prompt_len(self) -> int:
        """Prompt tokens: the server's count when it reported usage, else as built."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_len

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end is not None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean/max in milliseconds of values given in seconds."""
    ms = [v * 1000 for v in values_s]
    result: dict[str, float | None] = {f"p{q}": percentile(ms, q) for q in QUANTILES}
    result["mean"] = sum(ms) / len(ms) if ms else None
    result["max"] = max(ms) if ms else None
    return result


def ttft(record: RequestRecord) -> float | None:
    return None if record.first_token is None else record.first_token - record.start


def e2e(record: RequestRecord) -> float | None:
    return None if record.end is None else record.end - record.start


def tpot(record: RequestRecord) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    if record.first_token is None or record.end is None or record.output_tokens < 2:
        return None
    return (record.end - record.first_token) / (record.output_tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    times = record.chunk_times
    return [b - a for a, b in zip(times, times[1:])]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def request_detail(record: RequestRecord, t0: float) -> dict:
    """One request's own figures, for a per-request file; times in ms, `start_ms` from t0."""
    status = "cancelled" if record.cancelled else "failed" if record.error else "ok"
    return {
        "session": record.session, "turn": record.turn, "group": record.group,
        "status": status, "error": None if record.cancelled else record.error,
        "start_ms": None if record.end is None else _ms(record.start - t0),   # None: not sent
        "input_tokens": record.prompt_len,
        "output_tokens": record.output_tokens,
        "ttft_ms": _ms(ttft(record)), "tpot_ms": _ms(tpot(record)), "e2e_ms": _ms(e2e(record)),
        "itl_ms": [_ms(gap) for gap in itls(record)],
    }


def _present(values) -> list[float]:
    return [v for v in values if v is not None]


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> bool:
    """An ok request within both limits (a missing limit does not constrain)."""
    if not record.ok:
        return False
    first, per_token = ttft(record), tpot(record)
    if slo_ttft_ms is not None and (first is None or first * 1000 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and per_token is not None and per_token * 1000 > slo_tpot_ms:
        return False
    return True


def latency_figures(records: list[RequestRecord]) -> dict[str, dict]:
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": distribution(_present(ttft(r) for r in ok)),
        "tpot_ms": distribution(_present(tpot(r) for r in ok)),
        "itl_ms": distribution([gap for r in ok for gap in itls(r)]),
        "e2e_ms": distribution(_present(e2e(r) for r in ok)),
    }


def _length_mismatch(record: RequestRecord) -> bool:
    if record.exact_len:
        return record.output_tokens != record.output_len
    return record.output_tokens > record.output_len


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """Every figure of one run; `duration_s` is the measured phase's wall time."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    figures = {
        "num_ok": len(ok),
        "num_failed": sum(1 for r in records if r.error is not None and not r.cancelled),
        "num_cancelled": sum(1 for r in records if r.cancelled),
        "num_length_mismatch": sum(1 for r in ok if _length_mismatch(r)),
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": per_s(output_tokens),
        "input_tok_s": per_s(input_tokens),
        "requests_s": per_s(len(ok)),
        "goodput_requests_s": per_s(sum(1 for r in ok
                                        if meets_slo(r, slo_ttft_ms, slo_tpot_ms))),
        **latency_figures(records),
    }
    groups = sorted({r.group for r in records})
    if len(groups) > 1:
        figures["groups"] = {g: {"num_ok": sum(1 for r in ok if r.group == g),
                                 **latency_figures([r for r in records if r.group == g])}
                             for g in groups}
    figures["errors"] = sorted({r.error for r in records if r.error and not r.cancelled})[:5]
    return figures
