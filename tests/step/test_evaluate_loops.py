"""Sums and maxima over ragged axes (STeP §4.1 metrics) evaluate their compiled bodies to
the values computed by hand, and report a missing value as a walked expression does."""

from __future__ import annotations

import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step.dims import MaxOver
from torch2step.step.evaluate import evaluate


def test_nested_sum_over_ragged_lengths() -> None:
    i, j, b = sp.symbols("i j batch", integer=True)
    lens = sp.IndexedBase("L")
    expr = 3 * sp.Sum(sp.ceiling(lens[i] / 64) + j * b, (j, 0, lens[i] - 1), (i, 0, b - 1))
    values = [5, 0, 130, 64]
    want = 3 * sum(-(-n // 64) + jj * len(values) for n in values for jj in range(n))
    assert evaluate(expr, {"batch": len(values), "L": values}) == want


def test_max_over_with_gated_body_and_fraction() -> None:
    i, b = sp.symbols("i batch", integer=True)
    lens = sp.IndexedBase("L")
    gated = sp.Piecewise((24 * lens[i] + sp.Rational(1, 2), lens[i] > 0), (0, True))
    expr = MaxOver(gated, i, b) + sp.Sum(lens[i] ** 2, (i, 0, b - 1))
    values = [0, 7, 3]
    assert evaluate(expr, {"batch": 3, "L": values}) == pytest.approx(24 * 7 + 0.5 + 58)


def test_missing_index_value_is_named() -> None:
    i, b = sp.symbols("i batch", integer=True)
    expr = sp.Sum(sp.IndexedBase("L")[i], (i, 0, b - 1))
    with pytest.raises(StepTypeError, match=r"no value for L\[2\]"):
        evaluate(expr, {"batch": 3, "L": [1, 2]})
    with pytest.raises(StepTypeError, match="no value for batch"):
        evaluate(expr, {"L": [1, 2]})
