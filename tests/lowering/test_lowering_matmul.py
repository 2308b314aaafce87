"""Cyclotron-style matmul generators (seed 004 §4-§7): one recurrence, several schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hwmodel
import lowering as L
from lowering import ProgramError
from lowering.reference import run_reference

CHIP = hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), 4, 4)
GENERATORS = {
    "cannon": L.cannon_matmul,
    "summa": L.summa_matmul,
    "weight_stationary": L.weight_stationary_matmul,
    "systolic": L.systolic_matmul,
    "pumma": L.pumma_matmul,
}


def _hbm_traffic(ps: L.ProgramSet) -> dict[str, int]:
    """Elements loaded from / stored to each HBM tensor, loops multiplied out."""
    out: dict[str, int] = {}

    def walk(body, mult: int) -> None:
        for i in body:
            if isinstance(i, L.Loop):
                assert isinstance(i.count, int)
                walk(i.body, mult * i.count)
            elif isinstance(i, L.Load | L.Store):
                n = math.prod(i.region.extents) if i.region else 0
                key = f"{'load' if isinstance(i, L.Load) else 'store'} {i.tensor}"
                out[key] = out.get(key, 0) + mult * n

    for p in ps.programs:
        walk(p.body, 1)
    return out


def test_cannon_counts() -> None:
    ps = L.cannon_matmul(CHIP, 16, 16, 16)
    a = L.validate_programs(ps, CHIP)
    assert len(ps.programs) == 16 and len(ps.channels) == 32
    for ch in ps.channels:
        assert a.messages_sent(ch.name) == 3  # p - 1 shifts
        assert a.messages_received(ch.name, ch.dsts[0]) == 3
        assert a.bytes_sent(ch.name) == 3 * 4 * 4 * 4  # 4x4 fp32 blocks
    assert _hbm_traffic(ps) == {"load A": 256, "load B": 256, "store C": 256}
    assert {c.peak_sram_bytes for c in a.cores} == {3 * 64}
    # the skew: PE (1, 2) starts with A[1, 3] and B[3, 2]
    loads = [i for i in ps.programs[6].body if isinstance(i, L.Load)]
    assert loads[0].region == L.Region((4, 12), (4, 4))
    assert loads[1].region == L.Region((12, 8), (4, 4))
    # wrap-around ring: PE (1, 0) sends A to PE (1, 3)
    ring = {ch.name: ch for ch in ps.channels}
    assert (ring["A_W_1_0"].src, ring["A_W_1_0"].dsts) == (4, (7,))
    assert (ring["B_N_0_2"].src, ring["B_N_0_2"].dsts) == (2, (14,))


def test_summa_counts() -> None:
    ps = L.summa_matmul(CHIP, 16, 16, 16)
    a = L.validate_programs(ps, CHIP)
    assert len(ps.channels) == 32  # 4 owners per row for A + 4 per column for B
    for ch in ps.channels:
        assert len(ch.dsts) == 3  # multicast to the rest of the row / column
        assert a.messages_sent(ch.name) == 1
        assert all(a.messages_received(ch.name, d) == 1 for d in ch.dsts)
    assert _hbm_traffic(ps) == {"load A": 256, "load B": 256, "store C": 256}
    row1 = sorted(ch.dsts for ch in ps.channels if ch.name.startswith("A_bcastj_1_"))
    assert row1 == [(4, 5, 6), (4, 5, 7), (4, 6, 7), (5, 6, 7)]


def test_weight_stationary_counts() -> None:
    ps = L.weight_stationary_matmul(CHIP, 16, 16, 16, m_tiles=4)
    a = L.validate_programs(ps, CHIP)
    names = sorted(ch.name for ch in ps.channels)
    assert len([n for n in names if n.startswith("A_E")]) == 12
    assert len([n for n in names if n.startswith("C_S")]) == 12
    for ch in ps.channels:
        assert a.messages_sent(ch.name) == 4
    assert _hbm_traffic(ps) == {"load B": 256, "load A": 256, "store C": 256}
    # B stays: each PE loads its block once, before the loop
    first = ps.programs[5].body
    assert L.Load("b", "B", L.Region((4, 4), (4, 4))) in first
    stores = [p.core for p in ps.programs if "store" in L.format_program(p)]
    assert stores == [12, 13, 14, 15]  # partial sums leave the bottom row


def test_weight_stationary_is_a_different_schedule_of_the_same_recurrence() -> None:
    df = L.derive_dataflow(L.MatmulRecurrence(8, 8, 8), L.WEIGHT_STATIONARY, 4, 4, 2)
    kinds = [(r.kind, r.operand) for r in df.rules]
    assert ("prefetch", "B") in kinds and ("inject", "A") in kinds
    assert ("send", "C") in kinds  # partial sums flow
    assert df.accumulator_axis() == "k"
    assert df.schedule.time == "i"
    acc = [r.text for r in df.rules if r.kind == "accumulate"]
    cannon = L.derive_dataflow(L.MatmulRecurrence(8, 8, 8), L.CANNON, 4, 4, 4)
    assert acc == [r.text for r in cannon.rules if r.kind == "accumulate"]


CANNON_PE3 = """\
core 3:
  alloc a: fp32[2, 2]
  alloc b: fp32[2, 2]
  alloc c: fp32[2, 2]
  load a <- A[2:4, 0:2]
  load b <- B[0:2, 2:4]
  compute c <- zeros() {shape=2x2} [fp32]
  send A_W_1_1 <- a
  send B_N_1_1 <- b
  compute c <- matmul_acc(a, b, c) [fp32]
  recv a <- A_W_1_0
  recv b <- B_N_0_1
  compute c <- matmul_acc(a, b, c) [fp32]
  store C[2:4, 2:4] <- c
  free a
  free b
  free c"""

CANNON_DATAFLOW = """\
recurrence: C[i,j] = sum_k A[i,k] * B[k,j]
schedule cannon: i -> grid rows (4), j -> grid cols (4), k -> time (4 steps); A: rotate, B: rotate
blocks: i=4x2, j=4x2, k=4x2
  [pre ] skew       (i,j,(i+j) mod 4)_A <- A[i,(i+j) mod 4]
  [pre ] skew       (i,j,(i+j) mod 4)_B <- B[(i+j) mod 4,j]
  [pre ] zero       (i,j,0)_C <- 0
  [step] accumulate (i,j,k)_C <- (i,j,k-1)_C + (i,j,k)_A * (i,j,k)_B
  [step] rotate     (i,j,k)_A <- (i,(j+1) mod 4,k)_A
  [step] rotate     (i,j,k)_B <- ((i+1) mod 4,j,k)_B
  [post] export     C[i,j] <- (i,j,k_end)_C
"""

WS_PE2 = """\
core 2:
  alloc a: fp32[2, 2]
  alloc b: fp32[2, 2]
  alloc c: fp32[2, 2]
  load b <- B[2:4, 0:2]
  loop 2 as t:
    load a <- A[2*t:+2, 2:4]
    send A_E_1_0 <- a
    recv c <- C_S_0_0
    compute c <- matmul_acc(a, b, c) [fp32]
    store C[2*t:+2, 0:2] <- c
  free a
  free b
  free c"""


def test_golden_programs() -> None:
    assert L.format_program(L.cannon_matmul((2, 2), 4, 4, 4).programs[3]) == CANNON_PE3
    ws = L.weight_stationary_matmul((2, 2), 4, 4, 4, m_tiles=2)
    assert L.format_program(ws.programs[2]) == WS_PE2
    df = L.derive_dataflow(L.MatmulRecurrence(8, 8, 8), L.CANNON, 4, 4, 4)
    assert L.format_dataflow(df) == CANNON_DATAFLOW


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_reference_run_matches_numpy_on_4x4(name: str) -> None:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 12)).astype(np.float32)
    ps = GENERATORS[name](CHIP, 16, 8, 12)
    L.validate_programs(ps, CHIP)
    for depth in (1, 2):
        out = run_reference(ps, {"A": a, "B": b}, fifo_depth=depth)["C"]
        np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_generator_errors() -> None:
    with pytest.raises(ProgramError, match="'rotate' is Cannon's torus shift.*square grid"):
        L.cannon_matmul((2, 4), 8, 8, 8)
    with pytest.raises(ProgramError, match="M = 10 cannot be cut into 4 equal blocks along i"):
        L.cannon_matmul(CHIP, 10, 8, 8)
    with pytest.raises(ProgramError, match="K = 9 cannot be cut into 4 equal blocks along k"):
        L.summa_matmul(CHIP, 8, 9, 8)
    ipu = hwmodel.load_chip("ipu-hbm")
    with pytest.raises(ProgramError, match=r"all-to-all NoC.*pass grid=\(rows, cols\)"):
        L.summa_matmul(ipu, 8, 8, 8)
    with pytest.raises(ProgramError, match="does not fit chip 'mesh@4x4'"):
        L.summa_matmul(CHIP, 8, 8, 8, grid=(8, 1))
    with pytest.raises(ProgramError, match="unknown matmul schedule 'cannons'; choose one of"):
        L.matmul_programs(CHIP, 8, 8, 8, "cannons")
    moving = L.MatmulSchedule("bad", ("i", "j"), "prefetch", "stream")
    with pytest.raises(ProgramError, match=r"A\[i,k\] is not indexed by j.*'stream', 'broadcast'"):
        L.matmul_programs(CHIP, 8, 8, 8, moving)
    still = L.MatmulSchedule("bad", ("k", "j"), "stream", "stream")
    with pytest.raises(ProgramError, match="B is indexed by both space variables.*'prefetch'"):
        L.matmul_programs(CHIP, 8, 8, 8, still)


def test_all_to_all_chip_with_explicit_grid_validates() -> None:
    ipu = hwmodel.load_chip("ipu-hbm")
    ps = L.summa_matmul(ipu, 64, 64, 64, grid=(4, 4))
    assert [p.core for p in ps.programs] == list(range(16))
    L.validate_programs(ps, ipu)


def test_oversized_blocks_fail_sram_validation() -> None:
    ps = L.cannon_matmul(CHIP, 2048, 2048, 2048)
    with pytest.raises(ProgramError, match="core 0 needs 3145728 bytes of SRAM at its peak"):
        L.validate_programs(ps, CHIP)


def test_dtype_must_have_a_rate_on_the_chip() -> None:
    sda = hwmodel.load_chip("step-sda")
    L.validate_programs(L.cannon_matmul(sda, 64, 64, 64, dtype="bf16", grid=(4, 4)), sda)
    with pytest.raises(ProgramError, match="computes in fp32 but chip 'step-sda'"):
        L.validate_programs(L.cannon_matmul(sda, 64, 64, 64, grid=(4, 4)), sda)


def test_grid_placement_on_a_larger_mesh() -> None:
    mesh = hwmodel.load_chip("mesh")  # 32 x 46
    ps = L.cannon_matmul(mesh, 8, 8, 8, grid=(2, 2))
    assert [p.core for p in ps.programs] == [0, 1, 46, 47]
    L.validate_programs(ps, mesh)


def test_reference_detects_deadlock() -> None:
    b = L.ProgramBuilder("dead")
    b.channel("x", 0, 1)
    b.channel("y", 1, 0)
    for core, (inp, out) in {0: ("y", "x"), 1: ("x", "y")}.items():
        with b.core(core) as p:
            p.alloc("t", (1,), "fp32")
            p.recv(inp, "t")
            p.send(out, "t")
    with pytest.raises(ProgramError, match="deadlocks: core 0 waits for recv on 'y'"):
        run_reference(b.build(), {})


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(sorted(GENERATORS)))
    rows = draw(st.integers(1, 4))
    cols = rows if name == "cannon" else draw(st.integers(1, 4))
    bi, bj, bk = (draw(st.integers(1, 3)) for _ in range(3))
    steps = rows if name == "cannon" else draw(st.integers(1, 5))
    return name, rows, cols, bi, bj, bk, steps


@settings(max_examples=30, deadline=None)
@given(_cases())
def test_any_grid_and_block_count_computes_the_product(case) -> None:
    name, rows, cols, bi, bj, bk, steps = case
    sch = L.SCHEDULES[name]
    tiles = {sch.space[0]: rows, sch.space[1]: cols, sch.time: steps}
    M, N, K = tiles["i"] * bi, tiles["j"] * bj, tiles["k"] * bk
    ps = L.matmul_programs((rows, cols), M, K, N, sch, time_tiles=steps)
    chip = hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), rows, cols)
    analysis = L.validate_programs(ps, chip)
    for ch in ps.channels:  # every message is received by each destination
        sent = analysis.messages_sent(ch.name)
        assert all(analysis.messages_received(ch.name, d) == sent for d in ch.dsts)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    out = run_reference(ps, {"A": a, "B": b}, fifo_depth=1)["C"]
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
