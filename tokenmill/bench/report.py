"""Benchmark output: the terminal table, the JSON-lines results file, the compare table."""

from __future__ import annotations

import json
from pathlib import Path

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
COLUMNS = ("p50", "p90", "p99", "mean", "max")


def _num(value: float | None, width: int = 9, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _latency_rows(figures: dict, indent: str = "") -> list[str]:
    rows = [f"{indent}{'(ms)':<10}" + "".join(f"{c:>9}" for c in COLUMNS)]
    for name, key in LATENCIES:
        dist = figures[key]
        rows.append(f"{indent}{name:<10}" + "".join(_num(dist[c]) for c in COLUMNS))
    return rows


def format_table(result: dict) -> str:
    """A human-readable summary of one result line."""
    s = result["settings"]
    load = (f"rate {s['request_rate']}/s" if s["request_rate"]
            else f"concurrency {s['concurrency'] or 'unlimited'}")
    lines = [
        f"{result['label']} | {result['workload']} | {result['endpoint']} | {load} | "
        f"{result['model']} @ {result['base_url']}",
        f"requests: {result['num_ok']} ok, {result['num_failed']} failed, "
        f"{result['num_cancelled']} cancelled in {result['duration_s']:.2f} s",
        f"throughput: {result['output_tok_s']:.1f} output tok/s, "
        f"{result['input_tok_s']:.1f} input tok/s, {result['requests_s']:.2f} req/s, "
        f"goodput {result['goodput_requests_s']:.2f} req/s",
        *_latency_rows(result),
    ]
    for group, figures in result.get("groups", {}).items():
        lines.append(f"group {group} ({figures['num_ok']} ok):")
        lines += _latency_rows(figures, indent="  ")
    if result["num_length_mismatch"]:
        lines.append(f"WARNING: {result['num_length_mismatch']} requests returned a different "
                     "number of output tokens than asked for")
    cache = result.get("server_prefix_cache")
    if cache:
        lines.append(f"server prefix cache: {cache['hits']} of {cache['queries']} prompt tokens "
                     f"found ({100 * cache['hit_rate']:.0f}%)")
    drafts = result.get("server_spec_decode")
    if drafts:
        lines.append(f"server drafts: {drafts['accepted']} of {drafts['drafts']} kept "
                     f"({100 * drafts['acceptance_rate']:.0f}%)")
    steps = result.get("server_steps")
    if steps:
        kinds = (("decode", "decode-only"), ("prefill", "with prompt work"))
        lines.append("server steps: " + "; ".join(
            f"{steps[kind]['steps']} {name}, mean {steps[kind]['mean_ms']:.1f} ms"
            for kind, name in kinds if kind in steps))
    use = result.get("utilization")
    if use:
        line = f"utilization: {use['processed_tok_s']:.1f} tokens processed/s"
        if use["mfu"] is not None:
            line += f", MFU {100 * use['mfu']:.0f}% of {use['gemm_gflops']:.0f} GFLOP/s"
        if use["mbu"] is not None:
            line += (f"; MBU {100 * use['mbu']:.0f}% of {use['copy_gbps']:.1f} GB/s "
                     f"({use['decode_bytes_per_token'] / 1e6:.0f} MB a token)")
        lines.append(line)
    if not result["usage_reported"] and result["num_ok"]:
        lines.append("note: the server did not report usage; output tokens were counted as "
                     "stream chunks")
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def append_result(result: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(result) + "\n")


def load_results(paths: list[Path]) -> list[dict]:
    """Every result line of every file, in file order."""
    results = []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    results.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line: {exc}") from exc
    return results


def latest(results: list[dict]) -> dict[tuple[str, str], dict]:
    """The last result of each (label, workload)."""
    return {(r["label"], r["workload"]): r for r in results}


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return f"{'-':>7}"
    return f"{value / base:>6.2f}x"


def _compare_cells(r: dict, base: dict | None) -> str:
    cells = []
    for value, base_value in ((r["output_tok_s"], base and base["output_tok_s"]),
                              (r["ttft_ms"]["p50"], base and base["ttft_ms"]["p50"]),
                              (r["tpot_ms"]["p50"], base and base["tpot_ms"]["p50"])):
        cells.append(_num(value, 10) + " " + _ratio(value, base_value))
    return "".join(cells)


def compare_table(results: list[dict], baseline: str) -> str:
    """label x workload: output tok/s, TTFT p50, TPOT p50, each with its ratio to the
    baseline label on the same workload (throughput: higher is better; latency: lower)."""
    last = latest(results)
    if not any(label == baseline for label, _ in last):
        raise ValueError(f"no results with label {baseline!r}")
    workloads = list(dict.fromkeys(w for _, w in last))
    labels = [baseline] + [lb for lb in dict.fromkeys(lb for lb, _ in last) if lb != baseline]
    header = (f"{'workload':<18}{'label':<20}{'out tok/s':>10} {'ratio':>7}"
              f"{'TTFT p50':>10} {'ratio':>7}{'TPOT p50':>10} {'ratio':>7}")
    lines = [f"ratios against {baseline}", header]
    for workload in workloads:
        base = last.get((baseline, workload))
        for label in labels:
            r = last.get((label, workload))
            if r is not None:
                lines.append(f"{workload:<18}{label:<20}" + _compare_cells(r, base))
    return "\n".join(lines)
