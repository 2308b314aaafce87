"""``strategy="auto"`` (STeP §5 strategies searched): candidates pruned by the §4.1 formulas
under the budgets, the rest decided by the simulator, the table of candidates kept."""

from __future__ import annotations

import pytest
import torch

import torch2step
from models import get_layer
from torch2step.errors import LoweringError, ScheduleError


@pytest.fixture(scope="module")
def mixtral():  # type: ignore[no-untyped-def]
    return get_layer("mixtral-moe", tiny=True, batch=8)


@pytest.mark.slow
def test_auto_picks_the_fastest_candidate_that_fits_the_budget(mixtral) -> None:  # type: ignore[no-untyped-def]
    x = mixtral.example_inputs
    free = torch2step.compile(mixtral.module, x, chip="step-sda", strategy="auto")
    rows = free.strategy_table.splitlines()
    assert rows[0].startswith("strategy=auto: 12 candidates, chosen ")
    sims = [r for r in rows[2:] if r.rstrip().endswith(("simulated", "chosen"))]
    assert len(sims) == 12
    chosen = next(r for r in rows[2:] if r.rstrip().endswith("chosen"))
    cycles = [int(r.split()[1].replace(",", "")) for r in sims]
    assert int(chosen.split()[1].replace(",", "")) == min(cycles)
    # the chosen program computes the layer
    with torch.no_grad():
        want = mixtral.module(*x)
    want = want[0] if isinstance(want, tuple) else want
    got = free.run(*x)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # a budget just under the chosen candidate's §4.1 on-chip bytes prunes it
    onchip = int(chosen.split()[3].replace(",", ""))
    tight = torch2step.compile(mixtral.module, x, chip="step-sda", strategy="auto",
                               onchip_budget=onchip - 1)
    trows = tight.strategy_table.splitlines()[2:]
    assert any("pruned: §4.1 on-chip > budget" in r for r in trows)
    tchosen = next(r for r in trows if r.rstrip().endswith("chosen"))
    assert int(tchosen.split()[3].replace(",", "")) < onchip
    assert tight.strategy_table in tight.report(*x).notes


def test_auto_with_nothing_in_budget_is_a_clear_error(mixtral) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ScheduleError, match="none of the 12 candidate strategies"):
        torch2step.compile(mixtral.module, mixtral.example_inputs, chip="step-sda",
                           strategy="auto", onchip_budget=1)
    with pytest.raises(LoweringError, match="option strategy='fast'"):
        torch2step.compile(mixtral.module, mixtral.example_inputs, strategy="fast")
