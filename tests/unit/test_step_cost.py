"""The draft policy's fixed step cost from step times at two row counts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.spec.step_cost import MAX_FIXED_ROWS, fixed_rows_from

ROWS = st.tuples(st.integers(1, 8), st.integers(9, 64))
PER_ROW = st.floats(1e-5, 1e-1)


@given(ROWS, st.floats(0.0, 512.0), PER_ROW, st.integers(1, 5))
def test_steps_on_a_line_give_its_fixed_cost(rows, fixed, per_row, repeats):
    few, most = rows
    times = {r: [per_row * (fixed + r)] * repeats for r in (few, most)}
    assert math.isclose(fixed_rows_from(times), fixed, rel_tol=1e-6, abs_tol=1e-6)


@given(ROWS, st.floats(1e-4, 1.0))
def test_the_fastest_steps_count_not_the_slow_ones(rows, seconds):
    few, most = rows
    line = {few: seconds, most: seconds * (5 + most) / (5 + few)}   # F = 5
    times = {r: [t * 1.5, t, t * 50] for r, t in line.items()}     # steps hit by stalls
    assert math.isclose(fixed_rows_from(times), 5.0, rel_tol=1e-6)


@given(ROWS, st.floats(1e-4, 1.0), st.floats(0.5, 1.0))
def test_rows_that_cost_nothing_make_drafts_free(rows, seconds, shrink):
    few, most = rows   # as many rows or more, no longer (a GPU far from its limits)
    assert fixed_rows_from({few: [seconds], most: [seconds * shrink]}) == MAX_FIXED_ROWS


@given(ROWS, st.floats(1e-4, 1.0), st.floats(1.0, 100.0))
def test_the_cost_is_never_negative(rows, seconds, growth):
    few, most = rows   # more than proportional growth would mean a negative fixed part
    assert fixed_rows_from({few: [seconds], most: [seconds * most / few * growth]}) >= 0.0


def test_one_row_count_is_not_enough():
    with pytest.raises(ValueError, match="^step_seconds: "):
        fixed_rows_from({16: [0.1, 0.2]})
    with pytest.raises(ValueError, match="^step_seconds: "):
        fixed_rows_from({1: [0.1], 16: []})
