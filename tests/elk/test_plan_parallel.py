"""Planning speed-ups that must not change the plan: the candidate preload orders of ELK §4.4
scheduled on several processes, and the allocation's shortcut when the fastest plans fit
(ELK §4.3)."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
from test_algorithms import _items

import elk.reorder as reorder
from elk.allocate import Option, allocate, delta_heuristic, pareto
from elk.reorder import best_order, candidate_orders
from elk.schedule import Policy


@pytest.mark.parametrize("seed", range(40))
def test_allocation_shortcut_is_the_heuristic(seed: int) -> None:
    rng = random.Random(4300 + seed)
    for _ in range(50):
        groups = [
            pareto(
                [Option(rng.randint(1, 12), rng.uniform(0, 9)) for _ in range(rng.randint(0, 4))]
            )
            for _ in range(rng.randint(1, 2))
        ]
        cap = rng.randint(0, 24)
        got, want = allocate(groups, cap), delta_heuristic(groups, cap)
        assert got == want
        if got is not None:  # the same sums: bit for bit, not only close
            assert repr(got.time) == repr(want.time) and type(got.space) is type(want.space)


@pytest.mark.parametrize("seed", range(4))
def test_orders_on_two_processes_plan_as_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5100 + seed)
    # slots 0 and 2 of every layer read the most HBM bytes: their preloads may swap (ELK §4.4)
    items = [
        replace(it, hbm_bytes=1000 + it.hbm_bytes if it.slot != 1 else it.hbm_bytes)
        for it in _items(rng, 12, multi_preload=True, ports=True)
    ]
    cap = rng.randint(30, 40)
    pol = Policy(cap, window=4, beam=2, plan_branch=True, core_sram=8.0, workers=8)
    orders = candidate_orders(items, cap, 8)
    assert len(orders) > 1
    alone = reorder._schedules(items, pol, orders, 1)
    monkeypatch.setattr(reorder, "PARALLEL_OPS", 2)  # small enough to fork for
    assert reorder._schedules(items, pol, orders, 2) == alone
    assert best_order(items, pol, 8, jobs=2) == best_order(items, pol, 8, jobs=1)
    assert reorder._JOB is None  # nothing of the run is left behind


def test_plan_jobs_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH2STEP_PLAN_JOBS", "3")
    assert reorder.plan_jobs() == 3
    monkeypatch.setenv("TORCH2STEP_PLAN_JOBS", "0")
    assert reorder.plan_jobs() == 1
    monkeypatch.delenv("TORCH2STEP_PLAN_JOBS")
    assert reorder.plan_jobs() >= 1


def _niceness(k: int) -> int:
    return os.nice(0)


def test_a_yielding_plan_runs_its_processes_at_lower_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan made while a worker simulates yields it the CPU (torch2step.kernel.stack): its
    processes run at a lower priority, there only, and the plan is the same."""
    rng = random.Random(4421)
    items = _items(rng, 12, multi_preload=True, ports=True)
    pol = Policy(rng.randint(30, 40), window=4, beam=2, plan_branch=True, core_sram=8.0)
    orders = [tuple(range(len(items)))] * 2
    monkeypatch.setattr(reorder, "PARALLEL_OPS", 2)
    want = best_order(items, pol, 8, jobs=2)
    with reorder.yielding():
        assert best_order(items, pol, 8, jobs=2) == want
    monkeypatch.setattr(reorder, "_scheduled", _niceness)  # what each worker reports
    here = os.nice(0)
    assert reorder._schedules(items, pol, orders, 2) == [here, here]
    with reorder.yielding():
        assert reorder._schedules(items, pol, orders, 2) == [min(19, here + reorder.YIELD_NICE)] * 2
    assert reorder._schedules(items, pol, orders, 2) == [here, here]
    assert os.nice(0) == here
