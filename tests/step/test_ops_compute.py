"""Higher-order operators (Appendix A table 4) and the tile-function registry."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step import (
    BOOL,
    FnSpec,
    Graph,
    Index,
    RaggedDim,
    TileType,
    TupleType,
    dyn,
    fn,
    register_fn,
    registered_fns,
    run,
    zeros,
)

B, N = dyn("B"), dyn("N")
i = Index("i")
L = sp.IndexedBase("L")


def _scalar(v: float) -> np.ndarray:
    return np.full((1, 1), v, np.float32)


# ---------------------------------------------------------------- Map


def test_map_shape_rule_static_dynamic() -> None:
    g = Graph()
    x = g.input("x", TileType((16, 64)), (1, B, 4))
    w = g.input("w", TileType((64, 32)), (1, B, 4))
    y = g.map("matmul", x, w)
    assert y.type.shape == (1, B, 4) and y.type.dtype == TileType((16, 32))
    d = g.input("d", TileType((N, 64)), (1, 2))
    wt = g.input("wt", TileType((32, 64)), (1, 2))
    assert g.map("matmul_t", d, wt).type.dtype == TileType((N, 32))
    assert g.map("silu", d).type == d.type
    assert g.map("row_max", d).type.dtype == TileType((N, 1))


def test_map_errors_name_the_node() -> None:
    g = Graph()
    x = g.input("x", TileType((16, 64)), (1, 4))
    w = g.input("w", TileType((32, 32)), (1, 4))
    with pytest.raises(StepTypeError, match=r"Map %mm: function matmul: contraction sizes"):
        g.map("matmul", x, w, name="mm")
    with pytest.raises(StepTypeError, match="takes 2 arguments"):
        g.map("matmul", x, name="one")
    with pytest.raises(StepTypeError, match="fn is a map function"):
        g.map("retile_row", x)
    with pytest.raises(StepTypeError, match="unknown tile function 'nope'"):
        g.map("nope", x)


def test_map_interpretation_and_broadcast() -> None:
    g = Graph()
    x = g.input("x", TileType((2, 3)), (1, 2))
    s = g.input("s", TileType((2, 1)), (1, 2))
    g.output("y", g.map("mul", x, s))
    g.output("z", g.map(fn("scale", alpha=0.5), x))
    X = [np.arange(6, dtype=np.float32).reshape(2, 3) + k for k in range(2)]
    S = [np.array([[2.0], [3.0]], np.float32)] * 2
    res = run(g.build(), streams={"x": [X], "s": [S]})
    assert np.array_equal(res.outputs["y"].data[0][1], X[1] * S[1])
    assert np.array_equal(res.outputs["z"].data[0][0], X[0] * 0.5)
    assert res.total_flops == 2 * 6 + 2 * 6


# ---------------------------------------------------------------- Accum


def test_accum_shape_rules() -> None:
    g = Graph()
    x = g.input("x", TileType((16, 64)), (1, B, 4))
    a = g.accum(x, "add", zeros(16, 64), 1)
    assert a.type.shape == (1, B) and a.type.dtype == TileType((16, 64))
    rows = g.input("rows", TileType((1, 64)), (N,))
    packed = g.accum(g.promote(rows), "retile_row", zeros(0, 64), 1)
    assert packed.type.dtype == TileType((N, 64))  # dynamic tile (seed 000 §5.2)
    rag = g.input("rag", TileType((2, 2)), (1, B, RaggedDim("L", B)))
    r = g.accum(rag, "add", zeros(2, 2), 1)
    assert r.type.shape == (1, B)
    packed_rag = g.accum(
        g.input("rr", TileType((1, 8)), (1, B, RaggedDim("L", B))), "retile_row", zeros(0, 8), 1
    )
    assert packed_rag.type.dtype == TileType((L[i], 8)) and packed_rag.type.index == (None, i)
    with pytest.raises(StepTypeError, match="1 <= rank <= input rank"):
        g.accum(x, "add", zeros(16, 64), 0)
    with pytest.raises(StepTypeError, match="Accum %acc: function add: tile shapes"):
        g.accum(x, "add", zeros(8, 64), 1, name="acc")
    with pytest.raises(StepTypeError, match="init_fn is an init function"):
        g.accum(x, "add", fn("exp"), 1)


def test_accum_empty_reductions_follow_revet() -> None:
    """seed 003 §III-A: [[]], [[], []] and [] reduce to [0], [0, 0] and []."""
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, N, RaggedDim("K", N)))
    g.output("s", g.accum(x, "add", zeros(1, 1), 1))
    prog = g.build()
    for data, expect in (([[]], [0.0]), ([[], []], [0.0, 0.0]), ([], [])):
        res = run(prog, streams={"x": [data]})
        assert [float(t[0, 0]) for t in res.outputs["s"].elements()] == expect
    res = run(prog, streams={"x": [[[_scalar(1), _scalar(2)], [], [_scalar(5)]]]})
    assert [float(t[0, 0]) for t in res.outputs["s"].elements()] == [3.0, 0.0, 5.0]


def test_accum_matmul_and_online_softmax(rng: np.random.Generator) -> None:
    g = Graph()
    q = g.input("q", TileType((4, 8)), (1, 3))
    k = g.input("k", TileType((5, 8)), (1, 3))
    v = g.input("v", TileType((5, 6)), (1, 3))
    st = g.accum(
        g.zip(q, k, v),
        fn("online_softmax", scale=0.25),
        fn("online_softmax_init", rows=4, cols=6),
        1,
    )
    assert isinstance(st.type.dtype, TupleType)
    g.output("o", g.map("softmax_finalize", st))
    g.output("mm", g.accum(g.zip(q, g.map("transpose", k)), "matmul_acc", zeros(4, 5), 1))
    Q = rng.standard_normal((4, 8)).astype(np.float32)
    K = [rng.standard_normal((5, 8)).astype(np.float32) for _ in range(3)]
    V = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(3)]
    res = run(g.build(), streams={"q": [[Q] * 3], "k": [K], "v": [V]})
    s = Q @ np.concatenate(K).T * 0.25
    p = np.exp(s - s.max(1, keepdims=True))
    expect = (p / p.sum(1, keepdims=True)) @ np.concatenate(V)
    assert np.allclose(res.outputs["o"].data[0], expect, atol=1e-5)
    assert np.allclose(res.outputs["mm"].data[0], sum(Q @ kk.T for kk in K), atol=1e-4)


# ---------------------------------------------------------------- Scan


def test_scan_running_state_and_errors() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, 2, 3))
    s = g.scan(x, "add", zeros(1, 1), 1)
    assert s.type == x.type
    g.output("s", s)
    data = [[[_scalar(v) for v in row] for row in ([1, 2, 3], [4, 5, 6])]]
    res = run(g.build(), streams={"x": data})
    assert [[float(t[0, 0]) for t in row] for row in res.outputs["s"].data[0]] == [
        [1, 3, 6],
        [4, 9, 15],
    ]
    rows = g.input("rows", TileType((1, 4)), (1, 3))
    with pytest.raises(StepTypeError, match="Scan update must return the accumulator type"):
        g.scan(rows, "retile_row", zeros(0, 4), 1)


# ---------------------------------------------------------------- FlatMap


def test_flat_map_regular_and_ragged_counts() -> None:
    g = Graph()
    t = g.input("t", TileType((16, 8)), (1, B))
    rows = g.flat_map(t, fn("retile_streamify", rows=4))
    assert rows.type.shape == (1, 4 * B) and rows.type.dtype == TileType((4, 8))
    lens = g.input("lens", TileType((1, 2), "int64"), (1, B), ragged=[RaggedDim("Lt", B)])
    addrs = g.flat_map(g.repeat(lens, 1), fn("iota", count=sp.IndexedBase("Lt")[i]))
    assert str(addrs.type) == "Strm<Tile[1, 1] int64, 2>[1, B:i, Lt[i]]"
    flat = g.flat_map(lens, fn("iota", count=sp.IndexedBase("Lt")[i]))
    assert flat.type.shape == (1, sp.Sum(sp.IndexedBase("Lt")[i], (i, 0, B - 1)))
    g.output("rows", rows)
    g.output("addrs", addrs)
    g.output("flat", flat)
    T = [np.arange(128, dtype=np.float32).reshape(16, 8)] * 2
    res = run(
        g.build(),
        streams={"t": [T], "lens": [[np.array([[0, 3]]), np.array([[10, 2]])]]},
    )
    assert len(res.outputs["rows"].data[0]) == 8
    assert [[int(a[0, 0]) for a in r] for r in res.outputs["addrs"].data[0]] == [
        [0, 1, 2],
        [10, 11],
    ]
    assert res.bindings["Lt"] == {(0,): 3, (1,): 2}
    assert [int(a[0, 0]) for a in res.outputs["flat"].data[0]] == [0, 1, 2, 10, 11]


def test_flat_map_data_dependent_count_gets_fresh_symbol() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 4)), (1, 5))
    flags = g.input("pad", BOOL, (1, 5))
    kept = g.flat_map(g.zip(x, flags), "filter_padding", name="fp")
    assert str(kept.type) == "Strm<Tile[1, 4] fp32, 1>[1, fp_r0]"
    g.output("kept", kept)
    X = [np.full((1, 4), k, np.float32) for k in range(5)]
    P = [np.array([[k % 2 == 1]]) for k in range(5)]
    res = run(g.build(), streams={"x": [X], "pad": [P]})
    assert [float(t[0, 0]) for t in res.outputs["kept"].elements()] == [0, 2, 4]
    assert res.bindings["fp_r0"] == 3
    with pytest.raises(StepTypeError, match="fn is a flat function"):
        g.flat_map(x, "exp")


# ---------------------------------------------------------------- registry


def test_user_registered_function() -> None:
    spec = FnSpec(
        "test_double_rows",
        "map",
        1,
        lambda f, args: TileType((2 * args[0].shape[0], args[0].shape[1]), args[0].dtype),
        lambda f, x: np.concatenate([x, x]),
        flops=lambda f, args: 0,
    )
    register_fn(spec, replace=True)
    assert "test_double_rows" in registered_fns()
    with pytest.raises(StepTypeError, match="already registered"):
        register_fn(spec)
    g = Graph()
    x = g.input("x", TileType((N, 4)), (1, 1))
    y = g.map("test_double_rows", x)
    assert y.type.dtype == TileType((2 * N, 4))
    g.output("y", y)
    res = run(g.build(), streams={"x": [[np.ones((3, 4))]]})
    assert res.outputs["y"].data[0][0].shape == (6, 4)
    with pytest.raises(StepTypeError, match="kind must be one of"):
        FnSpec("bad", "reduce", 1, lambda f, a: a, lambda f, x: x)
    assert str(fn("scale", alpha=0.5)) == "scale(alpha=0.5)"
    assert fn("zeros", shape=(1, 2)) == fn("zeros", shape=[1, 2])
