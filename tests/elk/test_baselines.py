"""The baselines of ELK §6.1 as ELK's evaluation builds them: Basic preloads the next operator
that has data to preload, Static tries every split of a core's SRAM in 10 KiB steps."""

from __future__ import annotations

import pytest

from elk.allocate import Option
from elk.designs import STATIC_STEP, plan_design, static_splits
from elk.schedule import Item


def _op(name: str, exec_time: float, load: float, data: int) -> Item:
    """One operator with one exec plan (space 4) and, when it has ``data`` bytes in HBM, a
    preload of space 4 taking ``load`` cycles."""
    pre = (Option(4 if data else 0, 0.0),)
    return Item(name, (Option(4, exec_time),), (pre,), load if data else 0.0, hbm_bytes=data)


@pytest.mark.parametrize("middle_data", [0, 64])
def test_basic_preloads_through_the_next_operator_with_data(middle_data: int) -> None:
    """While ``a`` executes, Basic issues the preload of ``b`` and, when ``b`` has nothing to
    preload (a norm or a residual add), of ``c``, the next operator with data: its long
    preload then overlaps ``a``'s long execution instead of ``b``'s short one."""
    items = [_op("a", 20.0, 1.0, 64), _op("b", 1.0, 1.0, middle_data), _op("c", 1.0, 18.0, 64)]
    t = plan_design("basic", items, 1000.0)
    issued_before_a = t.steps[0].P
    if middle_data:
        assert issued_before_a == 2  # a and b: c waits until b executes
        assert t.total > 1.0 + 20.0 + 18.0
    else:
        assert issued_before_a == 3  # a, b and c
        assert t.total < 1.0 + 20.0 + 18.0


def test_static_sweeps_the_split_in_steps_of_a_core() -> None:
    """Static's execute-space shares: a step of at most :data:`STATIC_STEP` bytes of the core
    from the first share up to the whole core."""
    core = 624 * 1024
    shares = static_splits(core)
    assert shares[-1] == 1.0
    assert shares[0] * core <= STATIC_STEP
    steps = [(b - a) * core for a, b in zip(shares, shares[1:])]
    assert max(steps) <= STATIC_STEP + 1e-6
    assert len(static_splits(None)) > 11
