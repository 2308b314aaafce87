"""Routing and merging operators (Appendix A table 5; seed 001 §3.2.3 ordering)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step import (
    DONE,
    Graph,
    RaggedDim,
    SelectorType,
    StepRuntimeError,
    Stop,
    TileType,
    dyn,
    run,
    sel,
)

B = dyn("B")


def _v(x: float) -> np.ndarray:
    return np.full((1, 1), x, np.float32)


def _vals(stream_data: list) -> list:
    """Nested data with tiles replaced by their scalar value."""
    if isinstance(stream_data, list):
        return [_vals(x) for x in stream_data]
    return float(stream_data[0, 0])


# ---------------------------------------------------------------- Partition


def test_partition_shape_rule_fig3() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B, 2))
    s = g.input("s", SelectorType(3), (1, B))
    outs = g.partition(x, s, 3, name="route")
    assert [str(o.type) for o in outs] == [
        f"Strm<Tile[1, 1] fp32, 1>[route_n{k}, 2]" for k in range(3)
    ]
    named = g.partition(x, s, 3, count_names=("E0", "E1", "E2"))
    assert named[1].type.shape == (dyn("E1"), 2)


def test_partition_routes_multi_hot_chunks() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B, 2))
    s = g.input("s", SelectorType(3), (1, B))
    for k, o in enumerate(g.partition(x, s, 3, name="route")):
        g.output(f"o{k}", o)
    data = [[[_v(10 * b), _v(10 * b + 1)] for b in range(4)]]
    sels = [[sel(0, 1), sel(2), sel(), sel(0)]]
    res = run(g.build(), streams={"x": data, "s": sels})
    assert _vals(res.outputs["o0"].data) == [[0, 1], [30, 31]]
    assert _vals(res.outputs["o1"].data) == [[0, 1]]
    assert _vals(res.outputs["o2"].data) == [[10, 11]]
    assert [res.bindings[f"route_n{k}"] for k in range(3)] == [2, 1, 1]


def test_partition_ragged_chunks_become_fresh_ragged_dims() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B, RaggedDim("L", B)))
    s = g.input("s", SelectorType(2, 1), (1, B))
    o0, o1 = g.partition(x, s, 2, name="p")
    assert str(o0.type) == "Strm<Tile[1, 1] fp32, 1>[p_n0:p0_r_i0, p0_r0[p0_r_i0]]"
    g.output("o0", o0)
    g.output("o1", o1)
    data = [[[_v(1)] * 3, [_v(2)] * 1, [_v(3)] * 2]]
    res = run(g.build(), streams={"x": data, "s": [[sel(0), sel(1), sel(0)]]}, env={"L": [3, 1, 2]})
    assert res.bindings["p0_r0"] == {(0,): 3, (1,): 2}
    assert res.bindings["p1_r0"] == {(0,): 1}


def test_partition_errors() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B, 2))
    s = g.input("s", SelectorType(3), (1, 4))
    with pytest.raises(StepTypeError, match=r"Partition %p: sel shape equals the outer b\+1 dims"):
        g.partition(x, s, 3, name="p")
    s2 = g.input("s2", SelectorType(2), (1, B))
    with pytest.raises(StepTypeError, match="sel carries selectors over num_consumers outputs"):
        g.partition(x, s2, 3)
    deep = g.input("deep", SelectorType(3), (1, B, 2, 1))
    with pytest.raises(StepTypeError, match="selector rank b <= input rank a"):
        g.partition(x, deep, 3)


# ---------------------------------------------------------------- Reassemble


def test_reassemble_shape_rule_fig4() -> None:
    g = Graph()
    ins = [g.input(f"i{e}", TileType((1, 4)), (dyn(f"N{e}"), 2)) for e in range(3)]
    s2 = g.input("s2", SelectorType(3, 2), (1, B))
    out = g.reassemble(ins, s2)
    assert out.type.shape == (1, B, 2, 2) and out.type.rank == 3  # a + b + 1
    s = g.input("s", SelectorType(3), (1, B))
    rag = g.reassemble(ins, s, name="r")
    assert str(rag.type) == "Strm<Tile[1, 4] fp32, 3>[1, B:r_r_i1, r_r0[r_r_i1], 2]"
    bad = g.input("bad", TileType((1, 4)), (dyn("N9"), 3))
    with pytest.raises(StepTypeError, match="same inner dims"):
        g.reassemble([ins[0], bad, ins[2]], s)
    with pytest.raises(StepTypeError, match="sel carries selectors over the inputs"):
        g.reassemble(ins[:2], s)


def test_reassemble_order_and_stop_tokens() -> None:
    """seed 001: chunks are collected whole, in arrival order; the stop token goes up one."""
    g = Graph()
    a = g.input("a", TileType((1, 1)), (dyn("Na"), RaggedDim("La", dyn("Na"))))
    b = g.input("b", TileType((1, 1)), (dyn("Nb"), RaggedDim("Lb", dyn("Nb"))))
    s = g.input("s", SelectorType(2), (2,))
    g.output("r", g.reassemble([a, b], s, name="re"))
    prog = g.build()
    streams = {
        "a": [[_v(1), _v(2)]],
        "b": [[_v(7)], [_v(8), _v(9)]],
        "s": [sel(0, 1), sel(1)],
    }
    res = run(prog, streams=streams, arrival={"re": [1, 0, 1]})
    toks = [
        t if isinstance(t, (Stop, type(DONE))) else float(t[0, 0])
        for t in res.outputs["r"].tokens()
    ]
    assert toks == [7.0, Stop(1), 1.0, 2.0, Stop(2), 8.0, 9.0, Stop(2), DONE]
    # same-rate producers (default): chunk 0 of input 0 and of input 1 tie, lower index first
    res = run(prog, streams=streams)
    assert _vals(res.outputs["r"].data) == [[[1, 2], [7]], [[8, 9]]]
    assert res.bindings["re_r0"] == {(0,): 2, (1,): 1}


def test_reassemble_runtime_errors() -> None:
    g = Graph()
    a = g.input("a", TileType((1, 1)), (dyn("Na"),))
    b = g.input("b", TileType((1, 1)), (dyn("Nb"),))
    s = g.input("s", SelectorType(2, 1), (dyn("S"),))
    g.output("r", g.reassemble([a, b], s, name="re"))
    prog = g.build()
    with pytest.raises(StepRuntimeError, match="selects input 1 but it has no chunk left"):
        run(prog, streams={"a": [_v(1)], "b": [], "s": [sel(1)]})
    with pytest.raises(StepRuntimeError, match="chunks never selected"):
        run(prog, streams={"a": [_v(1), _v(2)], "b": [], "s": [sel(0)]})


# ---------------------------------------------------------------- EagerMerge


def test_eager_merge_shapes_order_and_selectors() -> None:
    g = Graph()
    a = g.input("a", TileType((1, 1)), (dyn("Na"), 2))
    b = g.input("b", TileType((1, 1)), (dyn("Nb"), 2))
    data, which = g.eager_merge([a, b], name="m")
    assert data.type.shape == (dyn("Na") + dyn("Nb"), 2)
    assert str(which.type) == "Strm<Sel[2, k=1], 0>[Na + Nb]"
    g.output("d", data)
    g.output("w", which)
    prog = g.build()
    streams = {"a": [[_v(1), _v(2)], [_v(3), _v(4)]], "b": [[_v(5), _v(6)]]}
    res = run(prog, streams=streams)
    assert _vals(res.outputs["d"].data) == [[1, 2], [5, 6], [3, 4]]
    assert [s.indices for s in res.outputs["w"].data] == [(0,), (1,), (0,)]
    res = run(prog, streams=streams, arrival={"m": [1, 0, 0]})
    assert _vals(res.outputs["d"].data) == [[5, 6], [1, 2], [3, 4]]
    with pytest.raises(StepRuntimeError, match="give each input index once per chunk"):
        run(prog, streams=streams, arrival={"m": [1, 1, 0]})


def test_eager_merge_errors() -> None:
    g = Graph()
    a = g.input("a", TileType((1, 1)), (dyn("Na"), 2))
    c = g.input("c", TileType((1, 1)), (dyn("Nc"),))
    with pytest.raises(StepTypeError, match=r"EagerMerge %m: all inputs have the same rank"):
        g.eager_merge([a, c], name="m")
    r = g.input("r", TileType((1, 1)), (B, RaggedDim("L", B)))
    with pytest.raises(StepTypeError, match="same inner dims"):
        g.eager_merge([a, r])
    r2 = g.input("r2", TileType((1, 1)), (dyn("C"), RaggedDim("K", dyn("C"))))
    ragged, _ = g.eager_merge([r, r2], name="rm")
    assert str(ragged.type) == "Strm<Tile[1, 1] fp32, 1>[B + C:rm_r_i0, rm_r0[rm_r_i0]]"
    assert sp.sstr(ragged.type.card()) == "Sum(rm_r0[rm_r_i0], (rm_r_i0, 0, B + C - 1))"
