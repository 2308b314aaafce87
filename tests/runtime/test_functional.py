"""Functional mode computes the right numbers; control values are real in both modes."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_testkit import a2a_chip, cannon_chip, cannon_programs, mesh_chip

import lowering
from lowering.isa import (
    Affine,
    Alloc,
    Channel,
    Compute,
    Cond,
    If,
    Load,
    LoadValue,
    Loop,
    Program,
    ProgramSet,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
    Store,
    TensorDecl,
)
from lowering.reference import run_reference
from runtime import Simulator, simulate

RNG = np.random.default_rng(7)
A = RNG.standard_normal((32, 48)).astype(np.float32)
B = RNG.standard_normal((48, 64)).astype(np.float32)


@pytest.mark.parametrize(
    "generator",
    [lowering.cannon_matmul, lowering.summa_matmul, lowering.weight_stationary_matmul],
)
def test_generated_matmuls_on_a_4x4_mesh_match_numpy(generator):
    chip = mesh_chip(4, 4)
    ps = generator(chip, 32, 48, 64, grid=(4, 4))
    r = simulate(ps, chip, mode="functional", inputs={"A": A, "B": B})
    np.testing.assert_allclose(r.tensors["C"], A @ B, rtol=1e-5, atol=1e-5)
    ref = run_reference(ps, {"A": A, "B": B})
    np.testing.assert_allclose(r.tensors["C"], ref["C"], rtol=1e-6, atol=1e-6)
    # timing mode follows the same control flow and gives the same cycles
    assert simulate(ps, chip).cycles == r.cycles


def test_generated_cannon_on_all_to_all_matches_numpy():
    chip = a2a_chip(16)
    ps = lowering.cannon_matmul((4, 4), 32, 48, 64)
    r = simulate(ps, chip, mode="functional", inputs={"A": A, "B": B})
    np.testing.assert_allclose(r.tensors["C"], A @ B, rtol=1e-5, atol=1e-5)


def test_blocked_cannon_with_barriers_matches_numpy():
    a = RNG.standard_normal((64, 64))
    b = RNG.standard_normal((64, 64))
    r = simulate(cannon_programs(4), cannon_chip(4), mode="functional", inputs={"A": a, "B": b})
    np.testing.assert_allclose(r.tensors["C"], a @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(r.tensors["A"], a.astype(np.float32))  # inputs untouched


def _routed_sum() -> ProgramSet:
    """Core 0 reads a count n and a selector from an int tensor, loads n rows of x, sums them
    (scatter-add Store), and forwards n to core 1, which branches on it."""
    rows = Loop(
        "n",
        (
            Load("r", "x", Region(("i", 0), (1, 4))),
            Store("r", "out", Region((0, 0), (1, 4)), accumulate=True),
        ),
        var="i",
    )
    p0 = (
        Alloc("r", (1, 4), "fp32"),
        LoadValue("n", "meta", (0,)),
        LoadValue("sel", "meta", (1,)),
        rows,
        SendValue("cnt", Affine(1, (("n", 2),))),
        If(Cond("sel", "&", 2), (Set("flag", 1),), (Set("flag", 0),)),
        SendValue("cnt", "flag"),
    )
    p1 = (
        Alloc("z", (2, 2), "fp32"),
        RecvValue("cnt", "m"),
        RecvValue("cnt", "f"),
        If(
            Cond("f", "==", 1),
            (Loop("m", (Compute("zeros", ("z",), (), (("shape", "2x2"),), "fp32"),)),),
        ),
    )
    return ProgramSet(
        (Program(0, p0), Program(1, p1)),
        (Channel("cnt", 0, (1,)),),
        (
            TensorDecl("meta", (2,), "int32"),
            TensorDecl("x", (8, 4), "fp32"),
            TensorDecl("out", (1, 4), "fp32"),
        ),
    )


@pytest.mark.parametrize("n,sel", [(0, 2), (3, 2), (5, 1)])
def test_control_values_drive_both_modes(n, sel):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    meta = np.array([n, sel])
    f = simulate(_routed_sum(), mesh_chip(1, 2), mode="functional", inputs={"meta": meta, "x": x})
    np.testing.assert_array_equal(f.tensors["out"][0], x[:n].sum(axis=0))
    t = simulate(_routed_sum(), mesh_chip(1, 2), inputs={"meta": meta})
    assert t.cycles == f.cycles
    zeros_runs = (2 * n + 1) if sel & 2 else 0
    assert t.stats.core(1).busy == zeros_runs * 1  # zeros 2x2 fp32: ceil(16 / 128) = 1 cycle
    assert t.stats.core(0).instructions == f.stats.core(0).instructions


def test_compute_only_loops_are_fast_forwarded_in_timing_mode():
    body = (
        Alloc("a", (32, 32)),
        Alloc("c", (32, 32)),
        Compute("zeros", ("c",), (), (("shape", "32x32"),)),
        Loop(1000, (Compute("matmul_acc", ("c",), ("a", "a", "c")),)),
        Store("c", "out"),
    )
    ps = ProgramSet((Program(0, body),), tensors=(TensorDecl("out", (32, 32)),))
    t = simulate(ps, mesh_chip(1, 1))
    f = simulate(ps, mesh_chip(1, 1), mode="functional")
    assert t.cycles == f.cycles
    tc = 2 * 32**3 // 256
    assert t.stats.core(0).busy == 16 + 1000 * tc
    assert t.stats.events.fast_forwarded == 1000 and f.stats.events.fast_forwarded == 0
    assert t.stats.events.stepped < 20 < f.stats.events.stepped


def test_simulator_runs_again_with_the_same_result():
    sim = Simulator(
        cannon_programs(3),
        cannon_chip(3),
        mode="functional",
        inputs={"A": np.eye(48), "B": np.eye(48)},
    )
    r1, r2 = sim.run(), sim.run()
    assert r1 == r2
    np.testing.assert_array_equal(r1.tensors["C"], np.eye(48, dtype=np.float32))


def test_recv_of_data_dependent_shape():
    # A message carries whatever shape the sender's buffer holds; the receiver's Compute sees it.
    p0 = (
        Alloc("b", (8, 4), "fp32"),
        LoadValue("n", "len", (0,)),
        Load("b", "x", Region((0, 0), ("n", 4))),
        Send("c", "b"),
    )
    p1 = (
        Alloc("r", (8, 4), "fp32"),
        Alloc("s", (8, 4), "fp32"),
        Recv("c", "r"),
        Compute("add", ("s",), ("r", "r"), dtype="fp32"),
        Store("s", "y", Region((0, 0), (3, 4))),
    )
    ps = ProgramSet(
        (Program(0, p0), Program(1, p1)),
        (Channel("c", 0, (1,)),),
        (
            TensorDecl("len", (1,), "int32"),
            TensorDecl("x", (8, 4), "fp32"),
            TensorDecl("y", (8, 4), "fp32"),
        ),
    )
    x = RNG.standard_normal((8, 4)).astype(np.float32)
    r = simulate(ps, mesh_chip(1, 2), mode="functional", inputs={"len": np.array([3]), "x": x})
    np.testing.assert_array_equal(r.tensors["y"][:3], 2 * x[:3])
    assert dict(r.stats.bytes_moved)["noc_messages"] == 3 * 4 * 4


def _until_stop(bound: int) -> ProgramSet:
    """Core 0 sends the first n rows of x (n read from ``meta``), then the stream's stop token
    carrying n; core 1 receives rows until the stop token (``Recv`` with ``stop``, in a loop of
    ``bound`` iterations guarded by a done flag), sums them into ``out`` and stores the count
    the token carried and the rows it counted."""
    p0 = (
        Alloc("r", (1, 4), "fp32"),
        LoadValue("n", "meta", (0,)),
        Loop("n", (Load("r", "x", Region(("i", 0), (1, 4))), Send("rows", "r")), var="i"),
        SendValue("rows", "n"),
    )
    got = (
        Store("q", "out", Region((0, 0), (1, 4)), accumulate=True),
        Set("k", Affine(1, (("k", 1),))),
    )
    p1 = (
        Alloc("q", (1, 4), "fp32"),
        Alloc("c", (1, 2), "int32"),
        Set("done", 0),
        Set("k", 0),
        Set("cnt", -1),
        Loop(
            bound,
            (
                If(
                    Cond("done", "==", 0),
                    (
                        Recv("rows", "q", stop="s"),
                        If(Cond("s", "<", 0), got, (Set("done", 1), Set("cnt", "s"))),
                    ),
                ),
            ),
        ),
        SendValue("back", "cnt"),
        SendValue("back", "k"),
    )
    p2 = (  # res[0, 0] counts to the token's value, res[0, 1] to the rows core 1 counted
        Alloc("one", (1, 1), "fp32"),
        Load("one", "ones"),
        RecvValue("back", "a"),
        RecvValue("back", "b"),
        Loop("a", (Store("one", "res", Region((0, 0), (1, 1)), accumulate=True),)),
        Loop("b", (Store("one", "res", Region((0, 1), (1, 1)), accumulate=True),)),
    )
    return ProgramSet(
        (Program(0, p0), Program(1, p1), Program(2, p2)),
        (Channel("rows", 0, (1,)), Channel("back", 1, (2,))),
        (
            TensorDecl("meta", (1,), "int32"),
            TensorDecl("x", (8, 4), "fp32"),
            TensorDecl("out", (1, 4), "fp32"),
            TensorDecl("ones", (1, 1), "fp32"),
            TensorDecl("res", (1, 2), "fp32"),
        ),
    )


@pytest.mark.parametrize("n", [0, 3, 8])
def test_a_loop_receives_until_the_stop_token(n):
    """One program serves every stream length: the loop ends on the stop token, whose value
    (the count) and the rows received agree, in functional and timing mode and in the
    reference interpreter."""
    ins = {
        "meta": np.array([n]),
        "x": np.arange(32, dtype=np.float32).reshape(8, 4),
        "ones": np.ones((1, 1), np.float32),
    }
    ps = _until_stop(9)
    lowering.validate_programs(ps, mesh_chip(1, 3))
    f = simulate(ps, mesh_chip(1, 3), mode="functional", inputs=ins)
    np.testing.assert_array_equal(f.tensors["out"][0], ins["x"][:n].sum(axis=0))
    np.testing.assert_array_equal(f.tensors["res"], [[n, n]])
    t = simulate(ps, mesh_chip(1, 3), inputs={"meta": ins["meta"]})
    assert t.cycles == f.cycles
    ref = run_reference(ps, ins)
    np.testing.assert_array_equal(ref["out"], f.tensors["out"])
    np.testing.assert_array_equal(ref["res"], [[n, n]])


def test_a_loop_receives_until_the_stop_token_on_an_mpi_rank():
    """The MPI backend runs the same program with the same results (one rank, in process)."""
    from runtime.mpi.launch import mpi_available

    if mpi_available() is not None:
        pytest.skip(f"the mpi extra is not installed: {mpi_available()}")
    from runtime.mpi import run_mpi

    ins = {
        "meta": np.array([5]),
        "x": np.arange(32, dtype=np.float32).reshape(8, 4),
        "ones": np.ones((1, 1), np.float32),
    }
    r = run_mpi(_until_stop(9), mesh_chip(1, 3), ins, timeout=30)
    np.testing.assert_array_equal(r.tensors["out"][0], ins["x"][:5].sum(axis=0))
    np.testing.assert_array_equal(r.tensors["res"], [[5, 5]])


def _refs_or_stop() -> ProgramSet:
    """Core 0 reads n from ``meta`` and sends a control value (a buffer reference, 7) when n is
    not zero, else the stream's stop token carrying n (``SendValue`` with ``stop``); core 1
    takes either with one ``RecvValue`` with ``stop`` and stores, under the guard it decides,
    the value it got (or the token's value plus 100)."""
    p0 = (
        LoadValue("n", "meta", (0,)),
        If(Cond("n", ">", 0), (SendValue("ref", 7),), (SendValue("ref", "n", stop=True),)),
    )
    p1 = (
        Alloc("one", (1, 1), "fp32"),
        Load("one", "ones"),
        Set("v", 0),
        RecvValue("ref", "v", stop="s"),
        If(
            Cond("s", "<", 0),
            (Loop("v", (Store("one", "res", Region((0, 0), (1, 1)), accumulate=True),)),),
            (
                Loop(
                    Affine(100, (("s", 1),)),
                    (Store("one", "res", Region((0, 1), (1, 1)), accumulate=True),),
                ),
            ),
        ),
    )
    return ProgramSet(
        (Program(0, p0), Program(1, p1)),
        (Channel("ref", 0, (1,)),),
        (
            TensorDecl("meta", (1,), "int32"),
            TensorDecl("ones", (1, 1), "fp32"),
            TensorDecl("res", (1, 2), "fp32"),
        ),
    )


@pytest.mark.parametrize("n", [0, 3])
def test_a_value_receive_tells_a_value_from_the_stop_token(n):
    """``RecvValue`` with ``stop``: one value message either way (the validator counts it), a
    control value lands in ``reg`` with ``stop = -1``, a stop token sets ``stop`` to its value;
    in functional and timing mode and in the reference interpreter."""
    ins = {"meta": np.array([n]), "ones": np.ones((1, 1), np.float32)}
    want = [[7, 0]] if n else [[0, 100]]
    ps = _refs_or_stop()
    lowering.validate_programs(ps, mesh_chip(1, 2))
    f = simulate(ps, mesh_chip(1, 2), mode="functional", inputs=ins)
    np.testing.assert_array_equal(f.tensors["res"], want)
    t = simulate(ps, mesh_chip(1, 2), inputs={"meta": ins["meta"]})
    assert t.cycles == f.cycles
    np.testing.assert_array_equal(run_reference(ps, ins)["res"], want)
    assert "recv_value v <- ref (stop -> s)" in lowering.format_programs(ps)
    assert "send_value ref <- n (stop)" in lowering.format_programs(ps)


def test_a_value_receive_tells_the_stop_token_on_an_mpi_rank():
    """The MPI backend marks a ``SendValue`` with ``stop`` too: the same results."""
    from runtime.mpi.launch import mpi_available

    if mpi_available() is not None:
        pytest.skip(f"the mpi extra is not installed: {mpi_available()}")
    from runtime.mpi import run_mpi

    for n, want in ((0, [[0, 100]]), (3, [[7, 0]])):
        ins = {"meta": np.array([n]), "ones": np.ones((1, 1), np.float32)}
        r = run_mpi(_refs_or_stop(), mesh_chip(1, 2), ins, timeout=30)
        np.testing.assert_array_equal(r.tensors["res"], want)
