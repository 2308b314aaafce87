"""The MPI backend runs the simulator's per-core programs on 2 and 4 ranks (mpiexec from the
mpi extra's wheel, oversubscribed on a small machine) with outputs equal to the simulator's
functional mode bit for bit, and reports deadlocks within its timeout (Cyclotron §9)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_programs import DEADLOCKS, fails_on_last_core, hbm_ordering, line_chip

import runtime
from runtime import DeadlockError
from runtime.mpi.bundle import DATAFLOWS, Bundle, dataflow_bundle
from runtime.mpi.launch import launch, mpi_available
from torch2step.mpirun import layer_bundle

REASON = mpi_available()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the mpi extra is not installed: {REASON}"
)
WALL = 240.0  # seconds for one mpiexec launch: nothing can hang the test run


@pytest.fixture(scope="module")
def bundles() -> dict[str, Bundle]:
    out = {name: dataflow_bundle(name, 32, 16, 24, (4, 4), seed=7) for name in DATAFLOWS}
    # SUMMA with more k panels than grid rows, and a non-square grid
    out["summa_k8"] = Bundle(
        *_with(dataflow_bundle("summa", 16, 32, 24, (2, 4), seed=8), k_tiles=8)
    )
    ordered, inputs = hbm_ordering()  # stores, accumulates and LoadValue across ranks
    out["hbm_ordering"] = Bundle(ordered, line_chip(2), inputs)
    out["layer"] = layer_bundle("qwen3-moe", batch=2, seed=3)
    return out


def _with(b: Bundle, k_tiles: int) -> tuple:
    from lowering import summa_matmul

    ps = summa_matmul(b.chip, 16, 32, 24, grid=(2, 4), k_tiles=k_tiles)
    return ps, b.chip, b.inputs


def _failing() -> dict[str, Bundle]:
    """The simulator tests' deadlocking programs and one failing on the last core."""
    out = {k: Bundle(make(), line_chip(n)) for k, (make, n) in DEADLOCKS.items()}
    bad, inputs = fails_on_last_core()
    out["too_small"] = Bundle(bad, line_chip(4), inputs)
    return out


# 4 ranks on a 2-core machine takes ~15 s to launch: with the longer cases (-m slow)
@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"]
)
def launched(request, bundles):
    """One mpiexec per rank count runs every bundle (the ranks import the kernels once)."""
    every = {**bundles, **_failing()}
    timeouts = [30.0 if k in bundles else 1.0 for k in every]
    res = launch(list(every.values()), request.param, timeout=timeouts, wall_limit=WALL)
    return request.param, dict(zip(every, res))


@pytest.mark.parametrize("name", [*DATAFLOWS, "summa_k8", "hbm_ordering", "layer"])
def test_outputs_equal_simulator_functional_mode(name, bundles, launched):
    n, runs = launched
    b, r = bundles[name], runs[name].check()
    sim = runtime.simulate(b.programs, b.chip, mode="functional", inputs=b.inputs)
    assert set(r.tensors) == set(sim.tensors)
    for k, v in sim.tensors.items():
        assert r.tensors[k].dtype == v.dtype
        assert np.array_equal(r.tensors[k], v), f"{name} on {n} ranks: tensor {k} differs"
    # the same traffic as the simulator counts: every load, store and message happened
    moved = dict(sim.stats.bytes_moved)
    assert r.bytes_moved() == {k: moved[k] for k in ("hbm_read", "hbm_write", "noc_messages")}
    assert len(r.ranks) == n
    assert sorted(c for s in r.ranks for c in s.cores) == sorted(
        p.core for p in b.programs.programs
    )
    if name == "hbm_ordering":  # Y + X, doubled, accumulated I[1] = 3 times: (Y + X) * 7
        want = (b.inputs["Y"] + b.inputs["X"]) * 7
        np.testing.assert_allclose(r.tensors["Y"], want, rtol=1e-6)
    elif name != "layer":
        np.testing.assert_allclose(r.tensors["C"], b.inputs["A"] @ b.inputs["B"], atol=1e-4)


def test_messages_cross_ranks_as_broadcasts_and_point_to_point(bundles, launched):
    n, runs = launched
    summa = runs["summa"]  # 4x4 PEs, a band of grid rows per rank
    assert sum(s.msgs_remote for s in summa.ranks) > 0
    assert sum(s.msgs_local for s in summa.ranks) > 0
    # a column multicast reaches every other rank: one Ibcast on 4 ranks, a message on 2
    assert (sum(s.broadcasts for s in summa.ranks) > 0) == (n == 4)
    assert all(s.wall_s > 0 for s in summa.ranks)


@pytest.mark.parametrize("name", list(DEADLOCKS))
def test_deadlocks_give_the_simulators_report_within_the_timeout(name, launched):
    n, runs = launched
    r = runs[name]
    make, cores = DEADLOCKS[name]
    assert r.error_kind == "deadlock", r.error
    with pytest.raises(DeadlockError):
        r.check()
    with pytest.raises(DeadlockError) as sim_err:
        runtime.simulate(make(), line_chip(cores))
    # every core line of the simulator's report is in the MPI report, with its rank
    lines = [ln.strip() for ln in str(sim_err.value).splitlines() if ln.startswith("  core")]
    assert lines
    for ln in lines:
        assert ln + " [rank" in r.error, (ln, r.error)
    assert f"deadlock on {n} MPI rank(s), no progress for 1 s" in r.error


def test_an_error_on_one_rank_stops_every_rank(launched):
    n, runs = launched
    r = runs["too_small"]
    assert r.error_kind == "mpi"
    assert f"core 3 on rank {n - 1}, `load m <- T`: [4, 4] elements" in r.error


def test_launch_has_a_wall_clock_limit():
    from runtime.mpi import MpiError

    ring = DEADLOCKS["receive_cycle"][0]()
    with pytest.raises(MpiError, match="did not finish within"):
        launch([Bundle(ring, line_chip(2))], 2, timeout=600, wall_limit=3)
