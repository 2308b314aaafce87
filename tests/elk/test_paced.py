"""Planning options of the ELK §6 figures: ELK §5's emulator contention (``Policy.paced``:
preloads reach the cores at HBM pace and an execution sharing cores with them slows by the port
cycles they take beyond its free ones) and a search window counted in data preloads."""

from __future__ import annotations

import dataclasses
import random

import pytest
from test_ideal import _items

from elk.contention import _paced
from elk.designs import DESIGNS, plan_design
from elk.model import Policy
from elk.schedule import _top


def test_paced_charges_what_arrives_during_the_execution() -> None:
    # 10 cycles, 3 free: the first preload (5 HBM cycles) delivers all its 4 port cycles, the
    # second (10 HBM cycles) half of its 6 before the execution ends: 7 - 3 = 4 cycles late
    assert _paced(10.0, 3.0, [(5.0, 4.0), (10.0, 6.0)]) == pytest.approx(4.0)
    # a preload on other cores still holds the HBM: the next one starts after the execution
    assert _paced(10.0, 0.0, [(10.0, 0.0), (5.0, 9.0)]) == 0.0
    # free port cycles absorb it
    assert _paced(10.0, 8.0, [(2.0, 5.0)]) == 0.0


@pytest.mark.parametrize("seed", range(8))
def test_ideal_bounds_every_paced_design(seed: int) -> None:
    rng = random.Random(900 + seed)
    items = _items(rng, 6)
    cap = rng.randint(16, 40)
    ideal = plan_design("ideal", items, cap).total
    for design in DESIGNS:
        try:
            t = plan_design(design, items, cap, workers=8, core_sram=cap, paced=True)
        except ValueError:
            continue  # this design does not fit the capacity
        assert ideal <= t.total + 1e-9, design


def test_window_counts_operators_that_preload_data() -> None:
    """``window_data``: the search window passes operators without HBM bytes (ELK §4.2's K
    counted in real preloads), so it reaches further ahead than ``window`` positions."""
    items = [
        dataclasses.replace(it, hbm_bytes=b)
        for it, b in zip(_items(random.Random(5), 8), (0, 10, 0, 0, 10, 0, 10, 10))
    ]
    order = list(range(8))
    assert _top(items, order, 1, Policy(10.0, window=2)) == 3
    assert _top(items, order, 1, Policy(10.0, window=2, window_data=True)) == 5
    assert _top(items, order, 1, Policy(10.0, window=9, window_data=True)) == 8
