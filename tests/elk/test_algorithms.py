"""ELK §4.2-§4.4 algorithms against brute force on small hand-made operator lists."""

from __future__ import annotations

import random

import pytest

from elk.allocate import Option, allocate, allocate_exhaustive, pareto
from elk.designs import DESIGNS, plan_design
from elk.reorder import candidate_orders, valid_order
from elk.schedule import Item, Policy, evaluate, exhaustive, schedule


def _items(rng: random.Random, n: int, multi_preload: bool, ports: bool = False) -> list[Item]:
    items = []
    for k in range(n):
        ex = pareto([Option(rng.randint(2, 10), rng.uniform(1, 10)) for _ in range(3)])
        extra: dict = {}
        if ports:  # core grids and per-core port cycles of each plan's preload (FCFS ports)
            extra = {
                "grids": tuple((1, rng.randint(1, 6)) for _ in ex),
                "ports": tuple(rng.uniform(0, 6) for _ in ex),
            }
        pres = []
        for e in ex:
            count = 2 if multi_preload else 1
            pres.append(
                pareto([Option(rng.randint(1, e.space), rng.uniform(0, 3)) for _ in range(count)])
            )
        items.append(
            Item(
                f"op{k}",
                ex,
                tuple(pres),
                rng.uniform(1, 12),
                hbm_bytes=rng.randint(0, 100),
                contended=tuple(o.time * 1.3 for o in ex),
                layer=k // 3,
                slot=k % 3,
                **extra,
            )
        )
    return items


def test_pareto_keeps_only_undominated() -> None:
    opts = [Option(4, 5.0), Option(2, 9.0), Option(4, 7.0), Option(3, 9.5), Option(8, 1.0)]
    got = pareto(opts)
    assert [(o.space, o.time) for o in got] == [(2, 9.0), (4, 5.0), (8, 1.0)]


@pytest.mark.parametrize("seed", range(40))
def test_allocation_fits_and_matches_brute_force_on_convex_curves(seed: int) -> None:
    rng = random.Random(seed)
    groups = []
    for _ in range(rng.randint(1, 4)):
        # convex curves: each step down saves space at a growing time price
        space, time, slope = rng.randint(20, 40), rng.uniform(1, 3), rng.uniform(0.05, 0.2)
        curve = []
        for _ in range(rng.randint(1, 4)):
            curve.append(Option(space, time))
            space -= 4
            time += 4 * slope
            slope *= 2
        groups.append(pareto(curve))
    cap = rng.randint(20, 120)
    got, best = allocate(groups, cap), allocate_exhaustive(groups, cap)
    assert (got is None) == (best is None)
    if got is not None and best is not None:
        assert got.space <= cap
        # Δ greedy is optimal on convex curves when each step has the same space saving
        assert got.time == pytest.approx(best.time)


@pytest.mark.parametrize("seed", range(40))
def test_allocation_never_exceeds_capacity_and_never_beats_optimum(seed: int) -> None:
    rng = random.Random(100 + seed)
    groups = [
        pareto([Option(rng.randint(1, 20), rng.uniform(0, 10)) for _ in range(4)])
        for _ in range(rng.randint(1, 4))
    ]
    cap = rng.randint(5, 60)
    got, best = allocate(groups, cap), allocate_exhaustive(groups, cap)
    assert (got is None) == (best is None)
    if got is not None and best is not None:
        assert got.space <= cap
        assert got.time >= best.time - 1e-9


@pytest.mark.parametrize("seed", range(60))
def test_inductive_schedule_equals_exhaustive_search(seed: int) -> None:
    """Theorem 4.2: the inductive schedule is optimal over every vector of preload numbers
    (allocation per step as in ELK §4.3), with one or several preload-state plans per plan."""
    rng = random.Random(seed)
    items = _items(rng, rng.randint(2, 6), multi_preload=seed % 2 == 0)
    pol = Policy(capacity=rng.randint(12, 30))
    best = exhaustive(items, pol)
    if best is None:
        with pytest.raises(ValueError):
            schedule(items, pol)
        return
    got = schedule(items, pol)
    assert got.total == pytest.approx(best.total)
    # the schedule is one of the enumerated ones: re-evaluating its P vector gives its total
    again = evaluate(items, pol, [s.P for s in got.steps])
    assert again is not None and again.total == pytest.approx(got.total)


@pytest.mark.parametrize("seed", range(40))
def test_inductive_schedule_with_port_queues_equals_exhaustive_search(seed: int) -> None:
    """With preloads queued on the executing cores' ports (ELK §4.3 contention, charged to the
    execute each preload is issued before) the inductive schedule is still optimal."""
    rng = random.Random(900 + seed)
    items = _items(rng, rng.randint(2, 6), multi_preload=seed % 2 == 0, ports=True)
    pol = Policy(capacity=rng.randint(12, 30), workers=8)
    best = exhaustive(items, pol)
    if best is None:
        return
    got = schedule(items, pol)
    assert got.total == pytest.approx(best.total)
    again = evaluate(items, pol, [s.P for s in got.steps])
    assert again is not None and again.total == pytest.approx(got.total)
    # the waits are charged: no cheaper than the same schedule with contention off
    free = evaluate(
        items, Policy(capacity=pol.capacity, workers=8, contention=False), [s.P for s in got.steps]
    )
    assert free is None or free.total <= got.total + 1e-9


@pytest.mark.parametrize("seed", range(30))
def test_schedule_respects_capacity_and_order(seed: int) -> None:
    rng = random.Random(500 + seed)
    items = _items(rng, rng.randint(3, 7), multi_preload=True)
    cap = rng.randint(15, 40)
    pol = Policy(capacity=cap)
    try:
        t = schedule(items, pol)
    except ValueError:
        return
    for s in t.steps:
        assert s.space <= cap
    steps = t.steps
    for a, b in zip(steps, steps[1:]):
        assert a.end <= b.start + 1e-9  # executes in order
        assert a.P <= b.P
    for i, s in enumerate(steps):
        assert t.preload_end[i] <= s.start + 1e-9  # preloaded before executing
    ends = [t.preload_end[op] for op in t.order]
    starts = [t.preload_start[op] for op in t.order]
    for k in range(1, len(ends)):
        assert ends[k - 1] <= starts[k] + 1e-9  # preloads one after another


@pytest.mark.parametrize("seed", range(30))
def test_reordering_is_valid_and_never_worse(seed: int) -> None:
    rng = random.Random(900 + seed)
    items = _items(rng, 6, multi_preload=False)
    cap = rng.randint(14, 30)
    for order in candidate_orders(items, cap):
        assert sorted(order) == list(range(6))
        assert valid_order(items, order, cap)
        # the same relative order in both identical layers
        first = [items[o].slot for o in order[:3]]
        second = [items[o].slot for o in order[3:]]
        assert first == second
    try:
        dyn = plan_design("elk_dyn", items, cap)
    except ValueError:
        return
    full = plan_design("elk_full", items, cap)
    assert full.total <= dyn.total + 1e-9


def test_invalid_order_is_rejected() -> None:
    big = (Option(10, 1.0),)
    items = [Item(f"op{k}", big, ((Option(10, 0.0),),), 5.0, hbm_bytes=10) for k in range(3)]
    assert valid_order(items, (0, 1, 2), 20)
    assert not valid_order(items, (1, 2, 0), 20)  # op 0 last: 1, 2 and 0 all held at once


def test_design_ordering_on_a_preload_bound_list() -> None:
    rng = random.Random(7)
    items = _items(rng, 8, multi_preload=True)
    totals = {d: plan_design(d, items, 40).total for d in DESIGNS}
    assert totals["ideal"] <= totals["elk_full"] + 1e-9
    assert totals["elk_full"] <= totals["elk_dyn"] + 1e-9


def test_per_core_sram_keeps_grids_that_must_share_cores_apart() -> None:
    """Two operators whose grids need more cores than the chip has share cores: they may be
    on chip together only if their per-core tiles fit one core's SRAM together."""
    ex = (Option(60, 5.0, None),)
    items = [
        Item(
            f"op{k}",
            ex,
            ((Option(60, 0.0),),),
            5.0,
            hbm_bytes=60,
            core_spaces=(7,),
            grids=((2, 3),),
        )
        for k in range(3)
    ]
    roomy = schedule(items, Policy(capacity=1000, core_sram=14, workers=8))
    tight = schedule(items, Policy(capacity=1000, core_sram=13, workers=8))
    assert any(roomy.preload_number(i) > 0 for i in range(3))
    assert all(tight.preload_number(i) == 0 for i in range(3))
    assert tight.total > roomy.total
    # enough cores for both grids side by side: no constraint
    apart = schedule(items, Policy(capacity=1000, core_sram=13, workers=12))
    assert apart.total == pytest.approx(roomy.total)
    mesh = Policy(capacity=1000, core_sram=13, mesh=(3, 5))
    assert mesh.must_share((2, 3), (2, 3)) and not mesh.must_share((1, 3), (2, 3))


def _brute_force_plans(items: list[Item], pol: Policy) -> float:
    """The best total over every vector of preload numbers and every vector of exec plans."""
    import itertools

    n = len(items)
    best = float("inf")
    for plans in itertools.product(*(range(len(it.execs)) for it in items)):
        for Ps in itertools.product(range(1, n + 1), repeat=n - 1):
            t = evaluate(items, pol, (*Ps, n), plans=plans)
            if t is not None:
                best = min(best, t.total)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_plan_branching_never_worse_and_never_beats_brute_force(seed: int) -> None:
    """ELK §4.3 weighs execution time against interconnect contention: keeping a suffix per
    set of resident operators a plan's cores are shared with (``plan_branch``) is never worse
    than the allocation's single choice, is one of the enumerated (P, plan) vectors and never
    beats the best of them."""
    rng = random.Random(500 + seed)
    items = _items(rng, rng.randint(2, 4), multi_preload=False, ports=True)
    plain_pol = Policy(capacity=rng.randint(12, 30), workers=8)
    pol = Policy(capacity=plain_pol.capacity, workers=8, plan_branch=True)
    try:
        plain = schedule(items, plain_pol)
    except ValueError:
        return
    got = schedule(items, pol)
    assert got.total <= plain.total + 1e-9
    again = evaluate(items, pol, [s.P for s in got.steps], plans=[s.exec_plan for s in got.steps])
    assert again is not None and again.total == pytest.approx(got.total)
    assert got.total >= _brute_force_plans(items, pol) - 1e-9


def test_smaller_grid_runs_beside_a_queued_preload() -> None:
    """An operator whose fastest plan needs every core waits behind the preload issued before
    it on those cores (ELK §4.3 contention); its slightly slower half-chip plan runs beside it.
    The allocation alone keeps the fastest plan; plan branching finds the half-chip one."""
    op0 = Item(
        "op0",
        (Option(4, 6.0, 0), Option(8, 5.0, 1)),
        ((Option(0, 0.0),), (Option(0, 0.0),)),
        0.0,
        grids=((1, 4), (1, 8)),
        ports=(0.0, 0.0),
    )
    op1 = Item(
        "op1",
        (Option(4, 1.0, 0),),
        ((Option(4, 0.0),),),
        10.0,
        hbm_bytes=40,
        grids=((1, 4),),
        ports=(10.0,),
    )
    # a first operator (the layer's input is read from HBM, behind every earlier preload)
    first = Item("in", (Option(1, 1.0, 0),), ((Option(0, 0.0),),), 0.0, grids=((1, 1),))
    items = [first, op0, op1]
    plain = schedule(items, Policy(capacity=100, workers=8))
    got = schedule(items, Policy(capacity=100, workers=8, plan_branch=True))
    assert plain.steps[1].exec_plan == 1 and got.steps[1].exec_plan == 0
    assert got.total < plain.total
    assert got.steps[1].P == 3 and got.steps[1].lead == 0.0  # op1's preload runs beside op0


def test_grids_apart_in_pairs_but_not_all_together_share_cores() -> None:
    """Three grids on a 3 x 5 mesh, each pair stacked in rows fits, all three do not: some
    core holds a tile of each, so an operator may run beside both others only if its tile and
    theirs fit one core's SRAM together (and it waits behind their preloads)."""
    from elk.schedule import _crowd

    pol = Policy(capacity=1000, core_sram=13, mesh=(3, 5))
    a, b = (2, 5), (1, 5)
    assert not pol.must_share(a, b) and not pol.must_share(b, b)
    assert not _crowd(pol, [a, b]) and _crowd(pol, [a, b, b])
    assert _crowd(Policy(capacity=1, workers=8), [(1, 3), (1, 3), (1, 3)])
    assert not _crowd(Policy(capacity=1, workers=9), [(1, 3), (1, 3), (1, 3)])
    # the incremental form the scheduler uses answers the same
    from elk.contention import _crowd_with, _totals

    for p in (pol, Policy(capacity=1, workers=8), Policy(capacity=1, workers=9)):
        for g in (a, b, (1, 3), (3, 5)):
            for rest in ([], [b], [a, b], [b, b], [(1, 3), (1, 3)]):
                assert _crowd_with(p, g, _totals(rest)) == _crowd(p, [g, *rest])
    items = [
        Item(
            f"op{k}",
            (Option(60, 5.0, None),),
            ((Option(60, 0.0),),),
            5.0,
            hbm_bytes=60,
            core_spaces=(7,),
            grids=(g,),
        )
        for k, g in enumerate((a, b, b))
    ]
    s = schedule(items, pol)
    assert s.preload_number(0) <= 1  # never all three on chip at once
    assert evaluate(items, pol, (3, 3, 3)) is None
    roomy = Policy(capacity=1000, core_sram=21, mesh=(3, 5))
    both = evaluate(items, roomy, (3, 3, 3))
    assert both is not None and both.preload_number(0) == 2
