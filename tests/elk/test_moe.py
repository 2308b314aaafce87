"""Dynamic MoE under ELK (ELK §7): a routed expert's preload waits for its routing."""

from __future__ import annotations

import dataclasses
import random

import pytest

from elk.errors import ElkError
from elk.moe import dynamic_vs_dense
from elk.ops import decode_step_ops
from elk.plan import plan_model
from elk.reorder import candidate_orders
from elk.schedule import Policy, exhaustive, schedule
from hwmodel.presets import load_chip
from tests.elk.test_algorithms import _items


@pytest.mark.parametrize("seed", range(30))
def test_routed_schedule_equals_exhaustive_search(seed: int) -> None:
    """With routed operators (preload only after their routing executed) the inductive schedule
    still equals the best of every vector of preload numbers, and obeys the rule."""
    rng = random.Random(3000 + seed)
    items = _items(rng, rng.randint(3, 6), multi_preload=seed % 2 == 0)
    j = rng.randint(1, len(items) - 1)
    items[j] = dataclasses.replace(items[j], after=rng.randint(0, j - 1))
    pol = Policy(capacity=rng.randint(12, 30))
    best = exhaustive(items, pol)
    if best is None:
        with pytest.raises(ElkError):
            schedule(items, pol)
        return
    got = schedule(items, pol)
    assert got.total == pytest.approx(best.total)
    router = items[j].after
    assert got.steps[router].P <= j  # not issued before the routing operator ran
    assert got.preload_start[j] >= got.steps[router].end - 1e-9
    for order in candidate_orders(items, pol.capacity):
        assert order.index(j) > max(order.index(x) for x in range(router + 1))


def test_dynamic_moe_preloads_experts_after_routing_and_reports_overlap() -> None:
    chip = load_chip("ipu-hbm")
    ops = decode_step_ops("qwen3-30b-a3b", 32, 2048, 2, dynamic=True)
    s = plan_model(ops, chip, "elk_full", window=8, beam=2, max_orders=4)
    idx = {op.name: k for k, op in enumerate(ops)}
    for layer in range(2):
        topk = s.timeline.steps[idx[f"L{layer}.topk"]]
        routed = [op for op in ops if op.layer == layer and op.routed_by is not None]
        assert len(routed) >= 2
        for op in routed:
            assert s.timeline.preload_start[idx[op.name]] >= topk.end - 1e-6
    rep = dynamic_vs_dense("qwen3-30b-a3b", 32, 2048, chip, layers=2, window=8, beam=2)
    assert rep["dynamic"]["cycles"] >= rep["dense"]["cycles"]
    assert 0.0 <= rep["overlap_kept"] <= 1.0 + 1e-9
    with pytest.raises(ElkError, match="no routed experts"):
        dynamic_vs_dense("llama3-8b", 32, 2048, chip, layers=1)
