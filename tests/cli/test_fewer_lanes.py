"""When the default expert lanes do not fit the chip, the report takes fewer and says so
(torch2step.fit); an explicit moe_lanes is never changed."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from torch2step.config_jobs import _collect
from torch2step.errors import ScheduleError
from torch2step.fit import fewer_lanes, fit_suggestions
from torch2step.lower.context import default_moe_lanes
from torch2step.named import report_layer

# the tiny Qwen3-MoE layer (8 experts) needs 137 units with a region per expert, 135 with 4
# lanes and 83 with 2: a 10 x 10 chip fits only the last
SMALL = ["noc.rows=10", "noc.cols=10"]


def test_lane_counts() -> None:
    assert default_moe_lanes(128) == 16 and default_moe_lanes(16) == 0
    assert fewer_lanes(128, 16) == [8, 4, 2]
    assert fewer_lanes(8, 0) == [4, 2]
    assert fewer_lanes(4, 2) == []
    assert fewer_lanes(128, 0) == [64, 32, 16, 8, 4, 2]


def test_default_lanes_that_do_not_fit_are_halved_and_said() -> None:
    run = report_layer("qwen3-moe", 8, tiny=True, sets=SMALL, reuse=False)
    explicit = report_layer(
        "qwen3-moe", 8, tiny=True, sets=SMALL, options={"moe_lanes": 2}, reuse=False
    )
    assert run.report.latency_cycles == explicit.report.latency_cycles
    assert run.report.options["moe_lanes"] == 2
    (note,) = [n for n in run.notes if n.startswith("expert lanes:")]
    assert "expert lanes: 2 (moe_lanes=2, STeP §5.3)" in note
    assert "a region per expert (8), does not fit" in note
    assert "it needs 137 units, the chip has 100 cores" in note
    assert "nor do 4 lanes" in note and "--option moe_lanes=0 keeps the default" in note
    assert note in str(run.report)


def test_explicit_lanes_are_kept() -> None:
    with pytest.raises(ScheduleError) as info:
        report_layer("qwen3-moe", 8, tiny=True, sets=SMALL, options={"moe_lanes": 0}, reuse=False)
    msg = str(info.value)
    assert "alone needs 137 units" in msg and "tried" not in msg
    assert "to make it fit, try (each needs fewer cores): --option moe_lanes=4; or " in msg


def test_suggestions_follow_the_layer_experts() -> None:
    run = report_layer("qwen3-moe", 8, tiny=True)
    layer = run.program.layer
    fixes = fit_suggestions("moe", {}, layer)
    assert fixes[:2] == ["--option moe_lanes=4", "--option moe_lanes=2"]
    assert fit_suggestions("moe", {}, layer, tried=(4, 2))[0].startswith("a chip with more")


class _Done(Future):  # type: ignore[type-arg]
    def __init__(self, result: Any = None, error: Exception | None = None) -> None:
        super().__init__()
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(result)


def test_a_later_configuration_of_one_operator_fails_the_report_at_once() -> None:
    head: Future = Future()  # type: ignore[type-arg]  # configuration 1: never finishes
    err = ScheduleError("operator 2 alone does not fit")
    submitted: list[tuple[tuple[int, ...], int]] = []

    def submit(group: tuple[int, ...], k: int) -> Future:  # type: ignore[type-arg]
        submitted.append((group, k))
        if k == 1:
            return head
        return _Done(error=err) if 2 in group else _Done(("rep", None))

    # configuration 2 (operators 2 and 3) fails: halved at once, and its first half, a single
    # operator, fails the report without waiting for configuration 1
    with pytest.raises(ScheduleError, match="operator 2 alone"):
        _collect(submit, [(0, 1), (2, 3)])
    assert submitted == [((0, 1), 1), ((2, 3), 2), ((2,), 2), ((3,), 3)]
    assert not head.done()
