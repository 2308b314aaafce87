"""Progress while simulating: the hook sees the simulated cycle advance, is rate-limited, and
leaves cycles and trace exactly as a run without it."""

from __future__ import annotations

import pytest
from runtime_testkit import cannon_chip, cannon_programs

import runtime.engine as engine
from runtime import simulate


def test_progress_reports_advancing_cycles_and_changes_nothing(monkeypatch) -> None:
    ps, chip = cannon_programs(3), cannon_chip(3)
    plain = simulate(ps, chip, trace=True)
    monkeypatch.setattr(engine, "PROGRESS_EVENTS", 1)
    monkeypatch.setattr(engine, "PROGRESS_SECONDS", 0.0)
    seen: list[tuple[int, int]] = []
    watched = simulate(ps, chip, trace=True, progress=lambda c, e: seen.append((c, e)))
    assert watched.cycles == plain.cycles and watched.trace_events == plain.trace_events
    assert len(seen) > 3
    cycles = [c for c, _ in seen]
    events = [e for _, e in seen]
    assert cycles == sorted(cycles) and events == sorted(events)
    assert cycles[0] < cycles[-1] <= plain.cycles
    # events as the result counts them (operations, grants, deliveries), not queue pops
    assert events[-1] == plain.stats.events.events != plain.stats.events.queue_pops


def test_progress_is_rate_limited_by_wall_time(monkeypatch) -> None:
    monkeypatch.setattr(engine, "PROGRESS_EVENTS", 1)
    monkeypatch.setattr(engine, "PROGRESS_SECONDS", 3600.0)
    seen: list[int] = []
    simulate(cannon_programs(3), cannon_chip(3), progress=lambda c, e: seen.append(c))
    assert len(seen) == 1  # only the final call


def test_progress_context_reaches_runs_deep_inside(monkeypatch) -> None:
    monkeypatch.setattr(engine, "PROGRESS_EVENTS", 1)
    monkeypatch.setattr(engine, "PROGRESS_SECONDS", 0.0)
    seen: list[int] = []
    with engine.progress(lambda c, e: seen.append(c)):
        r = simulate(cannon_programs(2), cannon_chip(2))
    assert seen and 0 < seen[-1] <= r.cycles
    seen.clear()
    simulate(cannon_programs(2), cannon_chip(2))
    assert seen == []  # off outside the block


@pytest.mark.parametrize("k", [2])
def test_progress_off_by_default(k: int) -> None:
    sim = engine.Simulator(cannon_programs(k), cannon_chip(k))
    sim.run()
    assert sim.progress is None
