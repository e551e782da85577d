"""Throughput-latency curves: output tok/s against TTFT p99 and TPOT p50, a line per label."""

from __future__ import annotations

from pathlib import Path


def _load_value(result: dict) -> float:
    s = result["settings"]
    return s["request_rate"] or s["concurrency"] or 0


def curves(results: list[dict], workload: str | None = None) -> dict[str, list[dict]]:
    """Points per line (label, plus the workload when several are shown), ordered by load.
    When a line holds several sweeps, only its latest sweep is drawn."""
    lines: dict[str, list[dict]] = {}
    workloads = {r["workload"] for r in results if workload in (None, r["workload"])}
    for r in results:
        if workload not in (None, r["workload"]):
            continue
        name = r["label"] if len(workloads) == 1 else f"{r['label']} / {r['workload']}"
        lines.setdefault(name, []).append(r)
    for name, points in lines.items():
        sweeps = [p["settings"].get("sweep_id") for p in points if p["settings"].get("sweep_id")]
        if sweeps:
            points = [p for p in points if p["settings"].get("sweep_id") == sweeps[-1]]
        lines[name] = sorted(points, key=_load_value)
    return lines


def plot_results(results: list[dict], out: Path, workload: str | None = None) -> Path:
    """Write the PNG and return its path."""
    import matplotlib
    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    lines = curves(results, workload)
    if not lines:
        raise ValueError("no results to plot")
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, title in ((axes[0], ("ttft_ms", "p99"), "TTFT p99 (ms)"),
                           (axes[1], ("tpot_ms", "p50"), "TPOT p50 (ms)")):
        for name, points in lines.items():
            xs = [p["output_tok_s"] for p in points]
            ys = [p[key[0]][key[1]] for p in points]
            ax.plot(xs, ys, marker="o", label=name)
            for x, y, p in zip(xs, ys, points):
                if y is not None:
                    ax.annotate(f"{_load_value(p):g}", (x, y), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("throughput vs latency (points labelled by concurrency or rate)")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
