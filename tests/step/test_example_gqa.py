"""The hand-built decode-GQA graph (online softmax over ragged KV caches, seed 000 §5.1/§5.4)
against plain PyTorch.  Golden printed graphs: tests/step/golden/ (``UPDATE_GOLDEN=1``)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.lower.blocks import add_gqa_decode, gqa_decode_graph, gqa_inputs, gqa_reference
from torch2step.step import Graph, RunResult, StepRuntimeError, dyn, metrics, run

GOLDEN = Path(__file__).parent / "golden"
D = 8


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with golden/<name> (``UPDATE_GOLDEN=1`` rewrites the file)."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text + "\n" == path.read_text(), f"{name} differs; rerun with UPDATE_GOLDEN=1"


def _run(
    checked_run: Callable[..., RunResult],
    *,
    hq: int,
    hkv: int,
    lens: list[int],
    max_len: int,
    tail: int = 0,
    tile_kv: int = 4,
    seed: int = 0,
) -> RunResult:
    scale = 1 / math.sqrt(D)
    prog = gqa_decode_graph(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=D, tail_rows=tail, tile_kv=tile_kv
    )
    inp = gqa_inputs(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=D,
        batch=len(lens),
        max_len=max_len,
        kv_lens=lens,
        tail_rows=tail,
        seed=seed,
    )
    res = checked_run(prog, tensors=inp)  # every §4.1 formula == what the run counted
    ref = gqa_reference(**inp, num_q_heads=hq, num_kv_heads=hkv, scale=scale, tail_rows=tail)
    np.testing.assert_allclose(res.tensors["out"], ref.numpy(), atol=1e-4, rtol=0)
    assert metrics(prog).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
    # K and V are read once per (request, KV head), never per query head: exactly the rows used
    rows = hkv * sum(n + tail for n in lens)
    assert res.read_bytes["attn_k"] == res.read_bytes["attn_v"] == rows * D * 4
    b = len(lens)
    assert res.offchip_bytes == 2 * b * hq * D * 4 + 8 * b + 2 * rows * D * 4
    return res


@pytest.mark.parametrize("hq,hkv", [(8, 2), (2, 2)], ids=["group4", "group1"])
@pytest.mark.parametrize(
    "lens,tail",
    [
        ([5, 1, 0, 9], 0),  # 5 and 9 are not multiples of tile_kv = 4; 0 sees no key
        ([0, 1, 4, 8], 1),  # length 0 still attends its one new (tail) row
        ([3], 2),
    ],
)
def test_gqa_matches_pytorch(
    checked_run: Callable[..., RunResult], hq: int, hkv: int, lens: list[int], tail: int
) -> None:
    res = _run(checked_run, hq=hq, hkv=hkv, lens=lens, max_len=10, tail=tail)
    if tail == 0 and 0 in lens:
        b = lens.index(0)
        assert not res.tensors["out"][b * hq : (b + 1) * hq].any()  # no key: 0


def test_seeded_random_lengths(checked_run: Callable[..., RunResult]) -> None:
    for seed in range(3):
        lens = np.random.default_rng(seed).integers(0, 12, size=3).tolist()
        _run(checked_run, hq=4, hkv=1, lens=lens, max_len=13, tail=1, tile_kv=3, seed=seed)


def test_kv_tiles_are_partial_at_the_end(checked_run: Callable[..., RunResult]) -> None:
    """A request of 9 + 1 rows gives KV tiles of 4, 4, 1 rows and 1 tail row (a tile never
    crosses from the request's rows to its tail rows): nothing padded is loaded, and each tile
    is one off-chip access of its rows."""
    res = _run(checked_run, hq=4, hkv=2, lens=[9, 2], max_len=11, tail=1)
    tiles = res.values["attn_k"].data[0]
    assert [[t.shape[0] for t in head] for head in tiles[0]] == [[4, 4, 1, 1]] * 2
    assert [[t.shape[0] for t in head] for head in tiles[1]] == [[2, 1]] * 2
    spans = [(int(a[0, 0]), int(r[0, 0])) for a, r in res.values["attn_kv_addr"].elements()]
    assert spans[:4] == [(0, 4), (4, 4), (8, 1), (10, 1)]  # request 0, KV head 0 (Lmax 11)


@pytest.mark.parametrize("n", [0, 1, 4, 5])  # empty, one row, exactly tile_kv, tile_kv + 1
@pytest.mark.parametrize("tail", [0, 2])
def test_kv_tile_edges(checked_run: Callable[..., RunResult], n: int, tail: int) -> None:
    res = _run(checked_run, hq=4, hkv=2, lens=[n, 3], max_len=8, tail=tail)
    tiles = res.values["attn_k"].data[0][0][0]
    expect = [4] * (n // 4) + [n % 4] * (n % 4 > 0) + [tail] * (tail > 0)
    assert [t.shape[0] for t in tiles] == expect


def test_one_program_many_batches(checked_run: Callable[..., RunResult]) -> None:
    """B and Lmax are symbols: the same program runs batches of different sizes."""
    prog = gqa_decode_graph(num_q_heads=4, num_kv_heads=2, head_dim=D, tile_kv=4)
    for lens, max_len in (([2, 7], 8), ([1, 0, 5, 3, 12], 12)):
        inp = gqa_inputs(
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=D,
            batch=len(lens),
            max_len=max_len,
            kv_lens=lens,
        )
        res = checked_run(prog, tensors=inp)
        ref = gqa_reference(**inp, num_q_heads=4, num_kv_heads=2, scale=1 / math.sqrt(D))
        np.testing.assert_allclose(res.tensors["out"], ref.numpy(), atol=1e-4)
        assert (res.bindings["B"], res.bindings["Lmax"]) == (len(lens), max_len)


def test_traffic_formula_with_static_sizes() -> None:
    prog = gqa_decode_graph(num_q_heads=4, num_kv_heads=2, head_dim=D, batch=3, max_len=10)
    const, kv = metrics(prog).offchip_bytes.as_coeff_Add()
    assert const == 2 * 12 * D * 4 + 3 * 8  # q and out (3*4 rows of D), kv_len (3 int64)
    coeff, rows = kv.as_coeff_Mul()  # K + V: 2 * D * 4 bytes per row loaded
    assert coeff == 2 * D * 4 and isinstance(rows, sp.Sum)
    # rows of every KV tile, summed over the tiles, the 2 KV heads and the 3 requests
    assert [(lo, hi) for _, lo, hi in rows.limits[1:]] == [(0, 1), (0, 2)]


def test_errors() -> None:
    with pytest.raises(StepTypeError, match="num_q_heads=6 must be a multiple of 4"):
        gqa_decode_graph(num_q_heads=6, num_kv_heads=4, head_dim=D)
    g = Graph()
    B = dyn("B")
    with pytest.raises(StepTypeError, match="do not fit"):
        add_gqa_decode(
            g,
            q=g.tensor("q", (B * 4, D)),
            k_cache=g.tensor("k", (B * 2 * 5, D)),
            v_cache=g.tensor("v", (B * 2 * 5, D)),
            kv_len=g.tensor("n", (B, 2), "int64"),
            out=g.tensor("o", (B * 4, D)),
            num_q_heads=4,
            num_kv_heads=2,
            scale=1.0,
        )
    prog = gqa_decode_graph(num_q_heads=2, num_kv_heads=1, head_dim=D, tail_rows=1)
    inp = gqa_inputs(
        num_q_heads=2, num_kv_heads=1, head_dim=D, batch=2, max_len=4, kv_lens=[3, 1], tail_rows=1
    )
    inp["kv_len"][0, 0] = 4  # 4 rows + 1 tail row do not fit in a cache of 4
    with pytest.raises(StepRuntimeError, match="KV length 4 must lie in 0..3"):
        run(prog, tensors=inp)


def test_golden_printed_graph() -> None:
    prog = gqa_decode_graph(num_q_heads=4, num_kv_heads=2, head_dim=D, tail_rows=1, tile_kv=4)
    check_golden("gqa_hq4_hkv2_d8_tail1_kv4.txt", str(prog))
    static = gqa_decode_graph(
        num_q_heads=2, num_kv_heads=2, head_dim=4, batch=2, max_len=6, scale=0.5, prefix="dec"
    )
    check_golden("gqa_hq2_hkv2_d4_b2_l6.txt", str(static))


@pytest.mark.parametrize("lanes", [2, 3, 9])  # 9 lanes > 4 (request, KV head) items: some idle
def test_lanes_match_pytorch(checked_run: Callable[..., RunResult], lanes: int) -> None:
    """Items spread over lanes (balanced by KV rows) compute the same as one pipeline."""
    lens, hq, hkv, tail = [7, 0], 4, 2, 1
    prog = gqa_decode_graph(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=D, tail_rows=tail, tile_kv=4, lanes=lanes
    )
    inp = gqa_inputs(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=D,
        batch=2,
        max_len=9,
        kv_lens=lens,
        tail_rows=tail,
    )
    res = checked_run(prog, tensors=inp)
    ref = gqa_reference(
        **inp, num_q_heads=hq, num_kv_heads=hkv, scale=1 / math.sqrt(D), tail_rows=tail
    )
    np.testing.assert_allclose(res.tensors["out"], ref.numpy(), atol=1e-4, rtol=0)
    kv = sum(v for k, v in res.read_bytes.items() if k.endswith(("_k", "_v")) and "_l" in k)
    assert kv == 2 * hkv * sum(n + tail for n in lens) * D * 4  # each row once, in some lane
    # list scheduling: the first items go to distinct lanes, the 8-row items before the 1-row
    per_lane = [sum(1 for _ in res.values[f"attn_l{r}_items"].elements()) for r in range(lanes)]
    assert sum(per_lane) == 4 and max(per_lane) <= -(-4 // lanes) + 1


def test_timing_only_holds_no_kv_values() -> None:
    """A timing-only run keeps the KV caches as zero-stride placeholders (their values steer
    nothing) and counts the same bytes as a full run."""
    prog = gqa_decode_graph(num_q_heads=4, num_kv_heads=2, head_dim=D, tile_kv=4, tail_rows=1)
    inp = gqa_inputs(
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=D,
        batch=3,
        max_len=9,
        kv_lens=[8, 0, 5],
        tail_rows=1,
    )
    full = run(prog, tensors=inp)
    timed = run(prog, tensors=inp, timing_only=True)
    assert timed.tensors["k_cache"].strides == (0, 0)
    assert timed.tensors["kv_len"].strides != (0, 0)  # steers the addresses: real values
    assert timed.read_bytes == full.read_bytes and timed.write_bytes == full.write_bytes
