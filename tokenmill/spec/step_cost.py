"""A decode step's fixed cost in rows' worth, from step times at two batch sizes.

A decode-only step of r rows takes about b * (F + r) seconds: F rows' worth of fixed work
(the weights streamed or rebuilt, the per-step Python) and b per row. F is what the draft
policy weighs a draft's row against: a few rows for SmolLM2 on a 2-core CPU, far more on a
GPU, where a step costs nearly the same at 1 and 64 rows. The engine times steps at two row
counts once, at start-up (engine/calibration.py); this turns the times into F.

Pure Python.
"""

from __future__ import annotations

MAX_FIXED_ROWS = 1024.0    # more rows cost nothing measurable: drafts are all but free


def fixed_rows_from(step_seconds: dict[int, list[float]]) -> float:
    """F from decode-step times keyed by rows: the line through the fastest steps at the
    fewest and the most rows, F = time at 0 rows / time per row, within [0, MAX_FIXED_ROWS].
    The fastest, not the median: whatever else runs on the machine only ever adds time, and
    more of it to longer steps."""
    if len(step_seconds) < 2 or not all(step_seconds.values()):
        raise ValueError("step_seconds: need step times at two or more row counts")
    few, most = min(step_seconds), max(step_seconds)
    t_few, t_most = min(step_seconds[few]), min(step_seconds[most])
    per_row = (t_most - t_few) / (most - few)
    if per_row * MAX_FIXED_ROWS <= t_few - per_row * few:
        return MAX_FIXED_ROWS
    return max(t_few / per_row - few, 0.0)
