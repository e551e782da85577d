"""Benchmark arithmetic on synthetic timings with known answers (pure, fast)."""

from __future__ import annotations

import pytest

from tokenmill.bench.metrics import (RequestRecord, distribution, itls, meets_slo, percentile,
                                     request_detail, summarize, tpot)
from tokenmill.bench.report import compare_table, format_table


def _record(start, first, chunk_gaps, tokens, group="main", error=None, expected=None):
    times = [first]
    for gap in chunk_gaps:
        times.append(times[-1] + gap)
    return RequestRecord(group=group, input_len=10, output_len=expected or tokens, start=start,
                         first_token=first, end=times[-1], chunk_times=times,
                         output_tokens=tokens, prompt_tokens=12, usage_reported=True,
                         error=error)


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_distribution_is_in_milliseconds():
    d = distribution([0.1, 0.2, 0.3])
    assert d["p50"] == pytest.approx(200) and d["max"] == pytest.approx(300)
    assert d["mean"] == pytest.approx(200)
    assert distribution([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}


def test_tpot_and_itl():
    r = _record(start=0.0, first=0.5, chunk_gaps=[0.1, 0.2, 0.3], tokens=4)
    assert tpot(r) == pytest.approx(0.6 / 3)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot(_record(0.0, 0.5, [], tokens=1)) is None


def test_a_request_detail_has_its_own_figures_in_ms():
    r = _record(start=10.0, first=10.5, chunk_gaps=[0.1, 0.2, 0.3], tokens=4)
    r.session, r.turn = 3, 1
    d = request_detail(r, t0=9.0)
    assert (d["session"], d["turn"], d["group"], d["status"], d["error"]) == \
        (3, 1, "main", "ok", None)
    assert d["start_ms"] == pytest.approx(1000) and d["ttft_ms"] == pytest.approx(500)
    assert d["e2e_ms"] == pytest.approx(1100) and d["tpot_ms"] == pytest.approx(200)
    assert d["itl_ms"] == pytest.approx([100, 200, 300])
    assert (d["input_tokens"], d["output_tokens"]) == (12, 4)
    failed = request_detail(RequestRecord(start=9.5, end=9.6, error="HTTP 500: boom"), 9.0)
    assert failed["status"] == "failed" and failed["error"] == "HTTP 500: boom"
    assert failed["ttft_ms"] is None and failed["itl_ms"] == []
    skipped = request_detail(RequestRecord(error="skipped: an earlier turn failed"), 9.0)
    assert skipped["start_ms"] is None                      # never sent
    cut = request_detail(RequestRecord(start=9.5, end=9.9, cancelled=True), 9.0)
    assert cut["status"] == "cancelled" and cut["error"] is None


def test_summarize_throughput_latencies_and_failures():
    records = [_record(0.0, 0.5, [0.1] * 9, tokens=10),
               _record(1.0, 1.2, [0.2] * 9, tokens=10),
               RequestRecord(output_len=10, start=2.0, end=2.1, error="HTTP 500: boom"),
               RequestRecord(output_len=10, start=2.0, end=2.5, cancelled=True)]
    s = summarize(records, duration_s=4.0)
    assert (s["num_ok"], s["num_failed"], s["num_cancelled"]) == (2, 1, 1)
    assert s["output_tokens"] == 20 and s["output_tok_s"] == pytest.approx(5.0)
    assert s["input_tokens"] == 24 and s["input_tok_s"] == pytest.approx(6.0)
    assert s["requests_s"] == pytest.approx(0.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(350) and s["ttft_ms"]["max"] == pytest.approx(500)
    assert s["tpot_ms"]["p50"] == pytest.approx(150)
    assert s["itl_ms"]["p50"] == pytest.approx(150) and s["itl_ms"]["max"] == pytest.approx(200)
    assert s["e2e_ms"]["p50"] == pytest.approx((1.4 + 2.0) / 2 * 1000)
    assert s["errors"] == ["HTTP 500: boom"] and s["num_length_mismatch"] == 0
    assert "groups" not in s


def test_goodput_counts_requests_within_both_slos():
    fast = _record(0.0, 0.1, [0.01] * 9, tokens=10)      # TTFT 100 ms, TPOT 10 ms
    slow_start = _record(0.0, 2.0, [0.01] * 9, tokens=10)  # TTFT 2000 ms
    slow_decode = _record(0.0, 0.1, [0.5] * 9, tokens=10)  # TPOT 500 ms
    records = [fast, slow_start, slow_decode]
    assert meets_slo(fast, 500, 50) and not meets_slo(slow_start, 500, 50)
    assert not meets_slo(slow_decode, 500, 50) and meets_slo(slow_decode, 500, None)
    assert summarize(records, 2.0, 500, 50)["goodput_requests_s"] == pytest.approx(0.5)
    assert summarize(records, 2.0, None, None)["goodput_requests_s"] == pytest.approx(1.5)


def test_groups_and_length_mismatch():
    records = [_record(0.0, 0.1, [0.05] * 3, tokens=4, group="stream"),
               _record(0.0, 0.2, [0.05, 2.0, 0.05], tokens=4, group="stream"),
               _record(0.5, 3.0, [0.1], tokens=2, group="long", expected=3)]
    s = summarize(records, 4.0)
    assert s["num_length_mismatch"] == 1
    assert s["groups"]["stream"]["itl_ms"]["max"] == pytest.approx(2000)
    assert s["groups"]["long"]["ttft_ms"]["p50"] == pytest.approx(2500)


def test_report_table_and_compare_ratios():
    base = {"label": "a", "workload": "random", "output_tok_s": 100.0,
            "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 20.0}}
    other = {"label": "b", "workload": "random", "output_tok_s": 150.0,
             "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 10.0}}
    table = compare_table([base, other], "a")
    row = next(line for line in table.splitlines() if line.startswith("random") and " b " in line)
    assert "1.50x" in row and "2.00x" in row and "0.50x" in row
    with pytest.raises(ValueError):
        compare_table([other], "a")
    s = summarize([_record(0.0, 0.1, [0.1], tokens=2, expected=3)], 1.0)
    result = {"label": "x", "workload": "random", "endpoint": "completions", "model": "m",
              "base_url": "u", "settings": {"request_rate": None, "concurrency": 4}, **s}
    assert "WARNING: 1 requests" in format_table(result)
