"""The layers of a decode step not simulated, timed by the simulated layers' steady period
(torch2step.kernel.steady): the period is found only where every copy of every core starts
exactly one period after the layer before, and the step it gives equals simulating every layer."""

from __future__ import annotations

import os

import pytest

from torch2step.kernel.steady import GAP, MIN_LAYERS, steady_period

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _starts(periods: list[int], cores: int = 3, sections: int = 2, per_layer: int = 5) -> list:
    """Copy starts of layers 3.. (copies of layer 2's sections, shifted by whole layers) whose
    layer ``l + 1`` starts ``periods[l - 3]`` after ``l``."""
    out, t = [], 1000
    for layer in range(3, len(periods) + 4):
        for c in range(cores):
            for s in range(sections):
                u = t + 7 * c + 100 * s
                out.append((c, 10 * s, (layer - 2) * per_layer, u, (u // 2, 0, 0, u - u // 2, 0)))
        if layer - 3 < len(periods):
            t += periods[layer - 3]
    return out


def _tiny_step() -> object:
    import torch2step
    from models.decoder import tiny_config_dict

    return torch2step.compile_config(
        tiny_config_dict("llama"), batch=4, past=64, chip="ipu-hbm", layers=8,
        execution="kernel", design="elk_full",
    )  # fmt: skip


def test_three_layers_one_period_apart_give_the_period() -> None:
    st = steady_period(_starts([500, 500, 430, 410]), 5, 6)
    assert (st.period, st.first, st.last) == (500, 3, 5)
    assert "500 cycles per layer" in str(st)


def test_no_period_when_one_section_is_late_or_too_few_layers() -> None:
    starts = _starts([500, 500, 430, 410])
    c, s, sh, t, cats = starts[7]  # layer 4, one core's section one cycle late
    starts[7] = (c, s, sh, t + 1, cats)
    st = steady_period(starts, 5, 6)
    assert st.period is None and "equal period" in st.why
    assert steady_period(_starts([500, 500]), 5, MIN_LAYERS - 1).period is None
    missing = [x for x in _starts([500, 500, 500]) if not (x[0] == 1 and x[2] == 10)]
    assert steady_period(missing, 5, 6).period is None  # a copy started in one layer only
    assert "whole layers" in steady_period([(0, 0, 7, 1, (0,) * 5)], 5, 6).why
    # every start one period on, but one core's time spent otherwise in the second pair
    moved = _starts([500, 500, 500, 500])
    c, s, sh, t, cats = moved[0]  # layer 3, core 0, section 0
    moved[0] = (c, s, sh, t, (cats[0] + 3, cats[1] - 3, *cats[2:]))
    kinds = list(moved)  # a stalled cycle charged to another kind of wait
    kinds[18] = (*kinds[18][:4], (kinds[18][4][0], 1, 0, kinds[18][4][3] - 1, 0))
    assert steady_period(kinds, 5, 6).period == 500
    assert steady_period(moved, 5, 6).first == 4  # layers 4-6 still repeat
    moved[18] = (*moved[18][:4], (0,) * 5)  # and not in layer 6
    assert steady_period(moved, 5, 6).period is None


def test_a_period_needs_the_same_backlog_at_each_layers_start() -> None:
    from runtime.backlog import backlog_gap

    queue = ((0, ((3, 64, 1.5),), (7,)), (20, (), (1, 2)))
    a = ((0.0, 2.25), ((), 0.0), (), queue)
    assert backlog_gap(a, a) == 0.0
    assert backlog_gap(a, ((0.0, 2.25 + 1e-12), ((), 0.0), (), queue)) < 1e-9
    assert backlog_gap(a, ((0.0, 3.25), ((), 0.0), (), queue)) == 1.0
    assert backlog_gap(a, ((1.0, 2.25), ((), 0.0), (), queue)) is None  # a port busy in one
    assert backlog_gap(a, ((0.0, 2.25), ((), 0.0), (), queue[:1])) is None  # fewer queued
    other = ((0, ((3, 64, 1.5),), (8,)), queue[1])  # another core to resume
    assert backlog_gap(a, ((0.0, 2.25), ((), 0.0), (), other)) is None

    starts, per = _starts([500, 500, 430, 410]), 5
    t0 = 1000  # _starts: layer 3's first copy (core 0, section 0) starts at cycle 1000
    marks = {(k - 2) * per: (0, 0, t0 + 500 * (k - 3), a) for k in (3, 4, 5)}
    st = steady_period(starts, per, 6, marks)
    assert (st.period, st.first, st.gap) == (500, 3, 0.0)
    assert "in the same state" in str(st)
    late = dict(marks)
    late[2 * per] = (0, 0, t0 + 500, ((0.0, 3.25), ((), 0.0), (), queue))  # layer 4's
    st = steady_period(starts, per, 6, late)
    assert st.period is None and "held other work" in st.why


def test_steady_period_times_the_step_as_simulating_every_layer() -> None:
    import torch2step
    from models.decoder import tiny_config_dict

    prog = torch2step.compile_config(
        tiny_config_dict("llama"), batch=4, past=64, chip="ipu-hbm", layers=8,
        execution="kernel", design="elk_full",
    )  # fmt: skip
    part, every = prog.report(sim_layers=6), prog.report(sim_layers=8)
    assert part.by_period and every.steady is None
    assert part.steady is not None and part.steady.period is not None
    assert part.cycles == every.cycles == every.sim.cycles
    assert part.cycles == part.sim.cycles + 2 * part.steady.period
    fewest = prog.report(sim_layers=5)  # cold, copied, two in the same state, the last
    assert fewest.by_period and fewest.cycles == every.cycles
    assert (fewest.steady.first, fewest.steady.last) == (3, 4)
    assert part.steady.gap is not None and part.steady.gap <= GAP  # the backlogs compared
    assert part.schedule is prog.schedule and part.sim.schedule is not prog.schedule
    d = part.to_dict()
    assert d["rest"] == "steady_period" and d["steady_period"] == part.steady.period
    assert "steady period" in str(part) and "planned as a model of its own" in str(part)


def test_a_shorter_step_planned_otherwise_times_the_rest_by_this_plans_period(
    monkeypatch,
) -> None:
    """A shorter step whose plan decides its first layers otherwise (ELK-Dyn's first preloads
    depend on the step's length) cannot time this one: the first layers of the step's own plan
    are simulated, their steady period times the rest, their last layers stand for the step's
    (an estimate), and the report says so.  The worker that began simulating the shorter step
    while this one was planned is stopped."""
    import dataclasses
    import multiprocessing

    from torch2step.kernel import stack
    from torch2step.kernel.steady import plans_differ

    prog = _tiny_step()
    monkeypatch.setattr(stack, "plans_differ", lambda *a: "operator 1 issues other preloads")
    rep = prog.report(sim_layers=6)
    assert not multiprocessing.active_children()
    s = prog.schedule
    assert rep.plan is None and rep.sim.schedule is s  # this plan's first 6 layers
    st = rep.steady
    assert st is not None and st.period is not None and "planned otherwise" in st.cut
    assert rep.cycles == rep.sim.cycles + 2 * st.period
    assert "layers 1-6 simulated" in str(rep) and "an estimate" in str(rep)
    d = rep.to_dict()
    assert d["rest"] == "steady_period_of_cut" and "planned otherwise" in d["own_plan_differs"]

    n = 4 * len(prog.body_ops.ops)
    assert plans_differ(s, s, n) == ""
    steps = list(s.timeline.steps)
    steps[1] = dataclasses.replace(steps[1], P=steps[1].P + 1)
    other = dataclasses.replace(s, timeline=dataclasses.replace(s.timeline, steps=tuple(steps)))
    assert "issues other preloads" in plans_differ(s, other, n)
    assert plans_differ(s, other, 1) == ""  # only the operators asked about


def test_the_shorter_step_simulated_in_a_worker_gives_the_report_of_one_process(
    monkeypatch,
) -> None:
    """The step's plan is made when first needed; a steady-period report simulates its shorter
    step in a worker meanwhile, with the result of doing both in this process."""
    from torch2step.config_jobs import JOBS_ENV, jobs_for

    prog = _tiny_step()
    assert prog._schedule is None  # not planned by compiling
    beside = prog.report(sim_layers=6)
    monkeypatch.setenv(JOBS_ENV, "1")
    assert jobs_for(2) == 1
    alone = _tiny_step().report(sim_layers=6)
    assert beside.by_period and alone.by_period
    assert (beside.cycles, beside.sim.cycles, beside.steady) == (
        alone.cycles,
        alone.sim.cycles,
        alone.steady,
    )
    assert beside.sim.result.copy_starts == alone.sim.result.copy_starts
    assert beside.schedule.cycles == alone.schedule.cycles


def test_the_plans_stand_for_the_whole_step_only_where_they_repeat() -> None:
    """layers_differ: the N-layer plan repeats its layers from the first steady one to its
    last layers, which the shorter plan's last layers decide alike."""
    import dataclasses

    from torch2step.kernel.steady import layers_differ

    prog = _tiny_step()  # 8 layers
    short = prog.shorter(6).schedule
    full = prog.schedule
    per = len(prog.body_ops.ops)
    assert layers_differ(full, short, per, 3, 4) == ""

    def preloaded_otherwise(s: object, op: int) -> object:
        tl = s.timeline  # type: ignore[attr-defined]
        pp = list(tl.preload_plan)
        pp[op] = -7  # another preload-state plan for operator ``op``
        return dataclasses.replace(s, timeline=dataclasses.replace(tl, preload_plan=tuple(pp)))

    heavy = max(range(per), key=lambda j: full.timeline.preload_plan[j])
    assert full.timeline.preload_plan[heavy] >= 0  # an operator the layers preload
    middle = layers_differ(preloaded_otherwise(full, 4 * per + heavy), short, per, 3, 4)
    assert "the 8-layer plan decides operator" in middle
    assert "otherwise than the layer before" in middle
    tail = layers_differ(full, preloaded_otherwise(short, 5 * per + heavy), per, 3, 4)
    assert "otherwise than the 6-layer plan its layer" in tail


def test_a_layers_start_records_every_cores_place_buffers_and_messages() -> None:
    """The state recorded at each layer's first copy (runtime.backlog) holds every core's
    place in its program, registers, buffers' pending accesses and unreceived messages; three
    steady layers' records agree, and one with a message more does not."""
    from runtime.backlog import backlog_gap
    from torch2step.kernel.stack import _simulated

    short = _tiny_step().shorter(6)
    rep, _ = _simulated(short, 6, 1, True)
    marks = rep.result.copy_marks
    per = len(short.body_ops.ops)
    got = [marks[(k - 2) * per][3] for k in (3, 4, 5)]
    assert all(len(m) == 7 for m in got)
    cores, messages = got[0][4], got[0][6]
    assert {c[7][0] for c in cores} <= {"copy", "call", "at"}
    assert any(c[7][0] == "copy" for c in cores)  # cores inside a copied section
    assert messages  # messages on their way when the layer starts
    assert backlog_gap(got[0], got[1]) is not None and backlog_gap(got[1], got[2]) is not None
    dst, held = messages[0]
    more = (*got[1][:6], ((dst, (*held, held[0])), *got[1][6][1:]))
    assert backlog_gap(got[0], more) is None
