"""ELK §6.1's Ideal is the roofline: no design's plan is faster, on hand-made operator lists
(where an exec plan on more cores preloads faster than the fastest execution) and on a decode
step of the project's models."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from elk.allocate import Option, pareto
from elk.designs import DESIGNS, IDEAL_POLICY, plan_design, roofline_plans
from elk.schedule import Item, evaluate


def _items(rng: random.Random, n: int, *, routed: bool = False) -> list[Item]:
    """Operators whose exec plans trade execution time against preload time (a plan on more
    cores executes faster or slower, and receives its preload through more ports), with port
    shares and grids so the designs charge contention, and slacks (ELK §4.5: the kernel
    consumes its preload piece by piece)."""
    items = []
    for k in range(n):
        ex = pareto([Option(rng.randint(2, 10), rng.uniform(1, 10)) for _ in range(3)])
        loads = tuple(rng.uniform(1, 12) for _ in ex)
        pres = tuple(
            pareto([Option(rng.randint(1, e.space), rng.uniform(0, 3)) for _ in range(2)])
            for e in ex
        )
        items.append(
            Item(
                f"op{k}",
                ex,
                pres,
                max(loads),
                hbm_bytes=rng.randint(0, 100),
                contended=tuple(o.time * 1.3 for o in ex),
                layer=k // 3,
                slot=k % 3,
                loads=loads,
                grids=tuple((1, rng.randint(1, 6)) for _ in ex),
                ports=tuple(rng.uniform(0, 6) for _ in ex),
                slacks=tuple(rng.uniform(0, o.time) for o in ex),
                after=k - 1 if routed and k % 3 == 2 else -1,
            )
        )
    return items


def _brute_roofline(items: list[Item]) -> float:
    """Every preload issued before the first execute, the best over every combination of exec
    plans (exhaustive)."""
    n = len(items)
    return min(
        t.total
        for plans in itertools.product(*(range(len(it.execs)) for it in items))
        if (t := evaluate(items, IDEAL_POLICY, [n] * n, plans=plans)) is not None
    )


@pytest.mark.parametrize("seed", range(12))
def test_roofline_plans_match_brute_force(seed: int) -> None:
    items = _items(random.Random(300 + seed), 5)
    n = len(items)
    t = evaluate(items, IDEAL_POLICY, [n] * n, plans=roofline_plans(items, None))
    assert t is not None
    assert t.total == pytest.approx(_brute_roofline(items))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("routed", [False, True])
def test_ideal_bounds_every_design(seed: int, routed: bool) -> None:
    rng = random.Random(700 + seed)
    items = _items(rng, 6, routed=routed)
    cap = rng.randint(16, 40)
    ideal = plan_design("ideal", items, cap).total
    for design in DESIGNS:
        try:
            t = plan_design(design, items, cap, workers=8, core_sram=cap)
        except ValueError:
            continue  # this design does not fit the capacity
        assert ideal <= t.total + 1e-9, design


def test_ideal_trades_execution_for_a_faster_preload() -> None:
    """Two operators: the second's fastest plan receives its preload through few ports; on
    more cores its preload ends sooner, which is worth its slower execution (the fastest
    plans are no roofline)."""
    ex = (Option(1, 4.0), Option(2, 2.0))
    items = [
        Item("a", (Option(1, 1.0),), ((Option(1, 0.0),),), 1.0, loads=(1.0,)),
        Item("b", ex, ((Option(1, 0.0),), (Option(2, 0.0),)), 20.0, loads=(5.0, 20.0)),
    ]
    ideal = plan_design("ideal", items, 1e9)
    assert ideal.steps[1].exec_plan == 0
    assert ideal.total == pytest.approx(1.0 + 5.0 + 4.0)  # a's preload, b's, then b


def test_ideal_bounds_the_designs_on_a_decode_layer() -> None:
    """One Llama-3-8B layer on the four-chip set-up: ELK-Full's searched plans (an attention
    plan on more cores, whose KV preload is faster) used to beat the fastest-plan Ideal."""
    from elk.ops import decode_step_ops
    from elk.plan import plan_model
    from hwmodel.presets import load_chip

    base = load_chip("ipu-hbm")
    chip = dataclasses.replace(
        base,
        name="ipu-hbm-x4",
        num_cores=4 * base.num_cores,
        hbm=dataclasses.replace(base.hbm, channels=4 * base.hbm.channels),
    )
    ops = decode_step_ops("llama3-8b", 32, 2048, 1)
    got = {d: plan_model(ops, chip, d, window=8, beam=2, max_orders=4).cycles for d in DESIGNS}
    assert got["ideal"] <= min(got.values()) + 1e-6
