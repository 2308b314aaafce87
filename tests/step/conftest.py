"""Shared helpers for the STeP IR tests (no torch needed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from torch2step.step import Program, RunResult, metrics, run


def run_and_check_metrics(prog: Program, **kwargs: Any) -> RunResult:
    """Run ``prog`` and assert that every §4.1 formula equals what the interpreter counted."""
    res = run(prog, **kwargs)
    m = metrics(prog)
    got = m.evaluate(res.bindings)
    assert got["offchip_read_bytes"] == sum(res.read_bytes.values())
    assert got["offchip_write_bytes"] == sum(res.write_bytes.values())
    assert got["onchip_bytes"] == res.onchip_total
    assert got["flops"] == res.total_flops
    per_node = m.evaluate_by_node(res.bindings)
    for name, row in per_node.items():
        assert row["offchip_read_bytes"] == res.read_bytes[name], name
        assert row["offchip_write_bytes"] == res.write_bytes[name], name
        assert row["onchip_bytes"] == res.onchip_bytes[name], name
        assert row["flops"] == res.flops[name], name
    return res


@pytest.fixture
def checked_run() -> Callable[..., RunResult]:
    return run_and_check_metrics


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
