"""A computation made in a forked child beside the process's work (torch2step.background): the
result is the one the call gives in this process, whether the child sent it, was waited for,
failed or was not started; and a report's §4.1 formulas so computed are the program's own."""

from __future__ import annotations

import os
import time

import pytest
import torch

import torch2step
from torch2step.background import beside
from torch2step.config_jobs import JOBS_ENV
from torch2step.step.evaluate import evaluate


def _pid_and_square(n: int, wait: float = 0.0):  # type: ignore[no-untyped-def]
    def fn() -> tuple[int, int]:
        time.sleep(wait)
        return os.getpid(), n * n

    return fn


def test_the_result_is_computed_in_a_child_and_the_child_is_released() -> None:
    job = beside(_pid_and_square(7))
    pid = job.pid
    assert pid is not None
    who, value = job.result()
    assert value == 49
    assert who == pid != os.getpid()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(pid, os.WNOHANG)


def test_a_child_not_done_is_waited_for() -> None:
    job = beside(_pid_and_square(12, wait=0.3))
    pid = job.pid
    who, value = job.result()  # asked at once: waited for (or computed here if not allowed)
    assert value == 144
    assert who in (pid, os.getpid())
    if os.geteuid() == 0:  # raising the child's priority is permitted: it was waited for
        assert who == pid


def test_without_a_second_worker_nothing_is_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JOBS_ENV, "1")
    job = beside(_pid_and_square(3))
    assert job.pid is None
    assert job.result() == (os.getpid(), 9)


def test_a_failing_call_raises_its_own_error_here() -> None:
    calls = []

    def fn() -> int:
        calls.append(os.getpid())
        raise ValueError("no formula for node n3")

    job = beside(fn)
    with pytest.raises(ValueError, match="no formula for node n3"):
        job.result()
    assert calls == [os.getpid()]  # the child's failure is not the result: raised here


def test_cancel_stops_the_child() -> None:
    job = beside(_pid_and_square(5, wait=30.0))
    pid = job.pid
    assert pid is not None
    t0 = time.perf_counter()
    job.cancel()
    job.cancel()  # idempotent
    assert time.perf_counter() - t0 < 20.0  # stopped, not waited for
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 64, bias=False)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_report_formulas_are_the_programs_own(monkeypatch: pytest.MonkeyPatch, jobs: str) -> None:
    monkeypatch.setenv(JOBS_ENV, jobs)
    torch.manual_seed(0)
    x = torch.randn(24, 32)
    prog = torch2step.compile(_Block(), (x,))
    rep = prog.report(x)
    _, res, _, _ = prog._execute((x,), timing_only=True, standins=True)
    m = prog.metrics
    assert rep.hbm_bytes_formula == str(m.offchip_bytes)
    assert rep.onchip_formula == str(m.onchip_bytes)
    assert rep.hbm_bytes_symbolic == int(evaluate(m.offchip_bytes, res.bindings))
    assert rep.peak_onchip_bytes == int(m.evaluate(res.bindings)["onchip_bytes"])
    assert rep.hbm_bytes_symbolic > 0 and rep.peak_onchip_bytes > 0
