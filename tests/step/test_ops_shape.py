"""Shape operators (Appendix A table 6; seed 001 Promote on empty streams)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step import (
    DONE,
    Graph,
    Index,
    RaggedDim,
    Stop,
    TileType,
    dyn,
    run,
)

B, N = dyn("B"), dyn("N")
i = Index("i")
L = sp.IndexedBase("L")


def _v(x: float) -> np.ndarray:
    return np.full((1, 1), x, np.float32)


def _vals(d: object) -> object:
    if isinstance(d, list):
        return [_vals(x) for x in d]
    return float(d[0, 0])  # type: ignore[index]


def _toks(stream: object) -> list:
    return [t if isinstance(t, (Stop, type(DONE))) else float(t[0, 0]) for t in stream.tokens()]  # type: ignore[attr-defined]


# ---------------------------------------------------------------- Flatten


def test_flatten_static_dynamic_ragged() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B, 3, 4))
    assert g.flatten(x, 0, 1).type.shape == (1, B, 12)
    assert g.flatten(x, 1, 2).type.shape == (1, 3 * B, 4)
    assert g.flatten(x, 0, 3).type.shape == (12 * B,)
    r = g.input("r", TileType((1, 1)), (1, B, RaggedDim("L", B)))
    f = g.flatten(r, 0, 1)
    assert f.type.shape == (1, sp.Sum(L[i], (i, 0, B - 1)))
    inner = g.input("inner", TileType((1, 1)), (1, B, 2, RaggedDim("L", B)))
    h = g.flatten(inner, 1, 2, name="fl")  # the axis L[i] is indexed by disappears
    assert str(h.type) == "Strm<Tile[1, 1] fp32, 2>[1, 2*B:fl_r_i1, fl_r0[fl_r_i1]]"
    with pytest.raises(StepTypeError, match=r"Flatten %bad: 0 <= min < max <= input rank"):
        g.flatten(x, 2, 2, name="bad")


def test_flatten_drops_stop_tokens() -> None:
    g = Graph()
    r = g.input("r", TileType((1, 1)), (1, B, RaggedDim("L", B)))
    g.output("f", g.flatten(r, 0, 1))
    res = run(g.build(), streams={"r": [[[_v(1), _v(2)], [], [_v(3)]]]})
    assert _toks(res.values["r"]) == [1.0, 2.0, Stop(1), Stop(1), 3.0, Stop(2), DONE]
    assert _toks(res.outputs["f"]) == [1.0, 2.0, 3.0, Stop(1), DONE]


# ---------------------------------------------------------------- Reshape


def test_reshape_innermost_pads_dynamic_dim() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 2)), (1, B, RaggedDim("L", B)))
    data, flags = g.reshape(x, 0, 2, pad=0.0)
    assert data.type.shape == (1, B, sp.ceiling(L[i] / 2), 2) and data.type.index[1] == i
    assert str(flags.type.dtype) == "Tile[1, 1] bool"
    g.output("d", data)
    g.output("p", flags)
    rows = [[np.full((1, 2), k, np.float32) for k in range(n)] for n in (3, 0, 2)]
    res = run(g.build(), streams={"x": [rows]})
    d = res.outputs["d"].data[0]
    assert [len(r) for r in d] == [2, 0, 1]
    assert d[0][1][1].tolist() == [[0.0, 0.0]]  # the padded element
    flags_out = [[[bool(f[0, 0]) for f in c] for c in r] for r in res.outputs["p"].data[0]]
    assert flags_out == [[[False, False], [False, True]], [], [[False, False]]]


def test_reshape_outer_dim_and_errors() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, 6, N))
    d, _ = g.reshape(x, 1, 3)
    assert d.type.shape == (1, 2, 3, N)
    g.output("d", d)
    data = [[[_v(10 * r + c) for c in range(2)] for r in range(6)]]
    res = run(g.build(), streams={"x": data})
    assert _vals(res.outputs["d"].data)[0][1][0] == [30.0, 31.0]
    with pytest.raises(StepTypeError, match="static and divisible by chunk"):
        g.reshape(x, 1, 4)
    with pytest.raises(StepTypeError, match="pads it: give pad"):
        g.reshape(x, 0, 4)
    s = g.input("s", TileType((1, 1)), (1, 8))
    assert g.reshape(s, 0, 4)[0].type.shape == (1, 2, 4)


# ---------------------------------------------------------------- Promote


def test_promote_shape_and_empty_stream() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (N,))
    p = g.promote(x)
    assert p.type.shape == (sp.Piecewise((1, N > 0), (0, True)), N) and p.type.rank == 1
    ps = g.promote(g.input("s", TileType((1, 1)), (3, 2)))
    pz = g.promote(g.input("z", TileType((1, 1)), (0,)))
    assert ps.type.shape == (1, 3, 2) and pz.type.shape == (0, 0)
    g.output("p", p)
    g.output("ps", ps)
    g.output("pz", pz)
    prog = g.build()
    full = run(prog, streams={"x": [_v(1), _v(2)], "s": [[_v(0)] * 2] * 3, "z": []})
    assert _toks(full.outputs["p"]) == [1.0, 2.0, Stop(1), DONE]
    # seed 001: an empty stream stays empty (no S1 for a tensor that does not exist)
    empty = run(prog, streams={"x": [], "s": [[_v(0)] * 2] * 3, "z": []})
    assert empty.outputs["p"].tokens() == [DONE]
    # inputs may also be given in stop-token form
    tok = run(prog, streams={"x": [_v(4), DONE], "s": [[_v(0)] * 2] * 3, "z": [DONE]})
    assert _toks(tok.outputs["p"]) == [4.0, Stop(1), DONE]


# ---------------------------------------------------------------- Expand / Repeat


def test_expand_along_ragged_reference() -> None:
    g = Graph()
    q = g.input("q", TileType((1, 1)), (1, B, 1))
    k = g.input("k", TileType((1, 1)), (1, B, RaggedDim("L", B)))
    e = g.expand(q, k, 0)
    assert e.type.shape == (1, B, L[i]) and e.type.index == (None, i, None)
    g.output("e", e)
    res = run(g.build(), streams={"q": [[[_v(1)], [_v(2)]]], "k": [[[_v(0)] * 3, [_v(0)]]]})
    assert _vals(res.outputs["e"].data) == [[[1.0] * 3, [2.0]]]
    assert res.onchip_bytes["expand0"] == 4


def test_expand_errors() -> None:
    g = Graph()
    q = g.input("q", TileType((1, 1)), (1, B, 2))
    k = g.input("k", TileType((1, 1)), (1, B, 4))
    with pytest.raises(StepTypeError, match=r"Expand %x: the expanded inner dims"):
        g.expand(q, k, 0, name="x")
    q2 = g.input("q2", TileType((1, 1)), (1, 3, 1))
    with pytest.raises(StepTypeError, match="agree on the outer dims"):
        g.expand(q2, k, 0)
    q3 = g.input("q3", TileType((1, 1)), (1, 1))
    with pytest.raises(StepTypeError, match="same rank"):
        g.expand(q3, k, 0)


def test_repeat_static_and_index_dependent() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B), ragged=[RaggedDim("L", B)])
    r2 = g.repeat(x, 2)
    assert r2.type.shape == (1, B, 2)
    rr = g.repeat(x, L[i])
    assert rr.type.shape == (1, B, L[i])
    g.output("r2", r2)
    g.output("rr", rr)
    res = run(g.build(), streams={"x": [[_v(1), _v(2)]]}, env={"L": [0, 3]})
    assert _vals(res.outputs["r2"].data) == [[[1.0, 1.0], [2.0, 2.0]]]
    assert _vals(res.outputs["rr"].data) == [[[], [2.0, 2.0, 2.0]]]
    with pytest.raises(StepTypeError, match="count may only use indices"):
        g.repeat(g.input("y", TileType((1, 1)), (1, 3)), L[i])


# ---------------------------------------------------------------- Zip


def test_zip_pairs_elements_and_checks_shapes() -> None:
    g = Graph()
    a = g.input("a", TileType((1, 1)), (1, B, RaggedDim("L", B)))
    j = Index("j")
    b = g.input("b", TileType((2, 1)), (1, B, RaggedDim("L", B, "j")))
    z = g.zip(a, b)
    assert z.type.index == (None, i, None) and str(z.type.dtype).startswith("(Tile[1, 1]")
    g.output("z", z)
    res = run(
        g.build(),
        streams={"a": [[[_v(1)], []]], "b": [[[np.ones((2, 1), np.float32)], []]]},
    )
    first = res.outputs["z"].data[0][0][0]
    assert isinstance(first, tuple) and first[1].shape == (2, 1)
    c = g.input("c", TileType((1, 1)), (1, B, 3))
    with pytest.raises(StepTypeError, match="all zipped streams have the same shape"):
        g.zip(a, c)
    _ = j
