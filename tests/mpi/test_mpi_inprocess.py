"""The MPI backend in this process (one rank, no mpiexec): semantics and error messages."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_programs import DEADLOCKS, line_chip

import runtime
from runtime import DeadlockError
from runtime.mpi.bundle import DATAFLOWS, dataflow_bundle
from runtime.mpi.launch import mpi_available

REASON = mpi_available()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the mpi extra is not installed: {REASON}"
)


@pytest.mark.parametrize("name", DATAFLOWS)
def test_one_rank_equals_simulator(name):
    from runtime.mpi import run_mpi

    b = dataflow_bundle(name, 16, 32, 24, (4, 4) if name == "cannon" else (2, 4), seed=1)
    r = run_mpi(b.programs, b.chip, b.inputs, timeout=30)
    sim = runtime.simulate(b.programs, b.chip, mode="functional", inputs=b.inputs)
    assert np.array_equal(r.tensors["C"], sim.tensors["C"])
    assert r.ranks[0].cores == tuple(sorted(p.core for p in b.programs.programs))


@pytest.mark.parametrize("name", list(DEADLOCKS))
def test_one_rank_deadlock_report(name):
    from runtime.mpi import run_mpi

    make, n = DEADLOCKS[name]
    with pytest.raises(DeadlockError, match=r"core\(s\) are blocked") as err:
        run_mpi(make(), line_chip(n), timeout=0.2)
    assert "[rank 0]" in str(err.value)


def test_missing_inputs_are_named():
    from runtime.mpi import MpiError, run_mpi

    b = dataflow_bundle("summa", 8, 8, 8, (2, 2))
    with pytest.raises(MpiError, match=r"missing inputs for tensors the programs read: \['B'\]"):
        run_mpi(b.programs, b.chip, {"A": b.inputs["A"]})
    with pytest.raises(MpiError, match="not declared tensors"):
        run_mpi(b.programs, b.chip, {**b.inputs, "Z": np.zeros(2)})
