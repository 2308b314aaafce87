"""A split layer's configurations reported in worker processes: the same reports, in the same
order, halving and errors included, as reported one after another in this process."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from torch2step.config_jobs import JOBS_ENV, jobs_for, run_groups
from torch2step.errors import InputError, ScheduleError


def _runner(too_big: int, broken: frozenset[int] = frozenset()):
    """Reports ``(group, k, pid)``; a group of more than ``too_big`` operators does not fit,
    a group holding an operator of ``broken`` alone fails with that operator named."""

    def run(group: tuple[int, ...], k: int) -> tuple[tuple, int]:
        if len(group) > too_big:
            raise ScheduleError(f"configuration {k}: {len(group)} operators do not fit")
        if len(group) == 1 and group[0] in broken:
            raise ScheduleError(f"operator {group[0]} does not fit alone")
        return (group, k), os.getpid()

    return run


GROUPS = [(0, 1, 2, 3), (4,), (5, 6), (7, 8, 9, 10, 11)]


@pytest.mark.parametrize("too_big", [1, 2, 4])
def test_workers_report_what_one_process_reports_halving_included(too_big: int) -> None:
    one = run_groups(_runner(too_big), GROUPS, 1)
    two = run_groups(_runner(too_big), GROUPS, 2)
    assert [(g, rep) for g, rep, _ in two] == [(g, rep) for g, rep, _ in one]
    # every operator once, in layer order, numbered 1.. in that order
    assert [i for g, _, _ in one for i in g] == list(range(12))
    assert [rep[1] for _, rep, _ in one] == list(range(1, len(one) + 1))
    assert all(len(g) <= too_big for g, _, _ in one)
    assert {pid for _, _, pid in one} == {os.getpid()}
    assert os.getpid() not in {pid for _, _, pid in two}  # the reports were made in workers


def test_the_first_failing_configuration_in_order_is_the_error_raised() -> None:
    for jobs in (1, 2):
        with pytest.raises(ScheduleError, match="operator 5 does not fit alone"):
            run_groups(_runner(1, frozenset({5, 9})), GROUPS, jobs)


def test_a_placement_error_comes_back_from_a_worker_with_the_cores_it_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch2step.spatial.placement import PlacementError

    def run(group: tuple[int, ...], k: int) -> tuple[tuple, int]:
        if group == (4,):
            err = PlacementError("operator 4 needs 1,536 cores", {"n4_moe": 1536})
            err.operators = ("MoEExperts",)
            raise err
        return (group, k), os.getpid()

    with caplog.at_level("WARNING", logger="torch2step"):
        with pytest.raises(PlacementError, match="1,536 cores") as info:
            run_groups(run, GROUPS, 2)
    assert info.value.cores == {"n4_moe": 1536}
    assert info.value.operators == ("MoEExperts",)
    # the worker's error arrived as itself: the pool did not break and rerun the layer here
    assert "workers stopped" not in caplog.text


def test_jobs_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JOBS_ENV, "3")
    assert jobs_for(8) == 3 and jobs_for(2) == 2
    monkeypatch.setenv(JOBS_ENV, "1")
    assert jobs_for(8) == 1
    monkeypatch.setenv(JOBS_ENV, "zero")
    with pytest.raises(InputError, match=JOBS_ENV):
        jobs_for(2)
    monkeypatch.delenv(JOBS_ENV)
    assert 1 <= jobs_for(2) <= 2


def _split_report(monkeypatch: pytest.MonkeyPatch, jobs: int, tmp_path) -> tuple[str, bytes]:
    pytest.importorskip("transformers")
    import torch2step
    from hwmodel import load_chip
    from hwmodel.presets import with_mesh_shape
    from models.decoder import decode_inputs, decoder_step, tiny_config

    monkeypatch.setenv(JOBS_ENV, str(jobs))
    cfg = tiny_config("llama")
    step, args = decoder_step(cfg, device="cpu"), decode_inputs(cfg, 3, 9)
    chip = with_mesh_shape(load_chip("mesh"), 4, 8)
    prog = torch2step.compile(step, args, chip=chip, execution="spatial")
    rep = prog.report(*args, trace=True)
    assert rep.dynamic["configurations"] > 1
    fields = {
        k: v
        for k, v in dataclasses.asdict(rep).items()
        if k not in ("simulation_s", "plan_s", "wall_s")
    }
    path = prog.write_trace(tmp_path / f"trace{jobs}.json")
    return json.dumps(fields, sort_keys=True, default=str), path.read_bytes()


def test_a_split_layer_reports_alike_in_workers_and_in_one_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    one = _split_report(monkeypatch, 1, tmp_path)
    two = _split_report(monkeypatch, 2, tmp_path)
    assert two[0] == one[0]
    assert two[1] == one[1]


def test_a_started_call_runs_beside_this_process_and_returns_its_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch2step.config_jobs import started

    monkeypatch.setenv(JOBS_ENV, "2")
    result = started(lambda: (os.getpid(), sum(range(10))))
    assert result.in_worker
    pid, total = result()
    assert total == 45 and pid != os.getpid()
    monkeypatch.setenv(JOBS_ENV, "1")
    here = started(lambda: os.getpid())
    assert not here.in_worker and here() == os.getpid()


def test_a_started_call_given_up_stops_its_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing
    import time

    from torch2step.config_jobs import started

    monkeypatch.setenv(JOBS_ENV, "2")
    t0 = time.perf_counter()
    job = started(lambda: time.sleep(60))
    job.cancel()
    assert not multiprocessing.active_children() and time.perf_counter() - t0 < 30
    assert not job.in_worker
    monkeypatch.setenv(JOBS_ENV, "1")
    started(lambda: 1).cancel()  # nothing started: nothing to stop


def test_a_daemonic_process_makes_a_started_call_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's worker is daemonic and may not have children: the call runs there."""
    import multiprocessing
    from types import SimpleNamespace

    from torch2step.config_jobs import started

    monkeypatch.setenv(JOBS_ENV, "2")
    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(daemon=True))
    job = started(lambda: os.getpid())
    assert not job.in_worker and job() == os.getpid()
