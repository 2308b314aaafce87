"""The interpreter's no-copy paths, Partition's recorded counts and the shared metric formulas.

* inputs are used in place (read-only), stores copy-on-write: the caller's arrays never change;
* loaded tiles are read-only views: a function writing into an argument fails loudly;
* ``run(check=False)`` learns Partition's counts (and fresh ragged sizes) as the check does;
* ``metrics`` computes each node shape once (``node_signature``) and gives the formulas that
  computing every node from its rules gives (seed 000 §4.1).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import sympy as sp
import torch

from torch2step.lower.blocks import moe_graph, moe_inputs
from torch2step.step import (
    FnSpec,
    Graph,
    Index,
    MaxOver,
    RaggedDim,
    SelectorType,
    StepRuntimeError,
    TileType,
    dyn,
    fn,
    metrics,
    run,
    sel,
)
from torch2step.step.dims import max_over
from torch2step.step.interp_context import tile_slice
from torch2step.step.metrics import node_metrics
from torch2step.step.node_signature import FormulaTemplate, signature

_functions = sys.modules["torch2step.step.functions"]
_metrics = sys.modules["torch2step.step.metrics"]

B = dyn("B")


def _scale_in_place() -> Graph:
    """``a <- 2 * a`` tile by tile: loads and stores the same tensor."""
    g = Graph("scale_in_place")
    a = g.tensor("a", (8, 8))
    g.linear_store(g.map(fn("scale", alpha=2.0), g.linear_load(a, (4, 4))), a)
    return g


# ---------------------------------------------------------------- no copies, copy-on-write


def test_store_into_callers_tensor_copies_on_write() -> None:
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    before = a.copy()
    res = run(_scale_in_place().build(), tensors={"a": a})
    np.testing.assert_array_equal(a, before)  # the caller's array is untouched
    np.testing.assert_array_equal(res.tensors["a"], 2 * before)  # tiles loaded before the store
    assert not np.shares_memory(res.tensors["a"], a)
    assert res.tensors["a"].flags.writeable


def test_torch_input_is_read_in_place_and_left_unchanged() -> None:
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    before = t.clone()
    g = Graph("copy_rows")
    a, b = g.tensor("a", (8, 8)), g.tensor("b", (8, 8))
    g.linear_store(g.linear_load(a, (4, 8)), b)
    res = run(g.build(), tensors={"a": t})
    assert torch.equal(t, before)
    np.testing.assert_array_equal(res.tensors["b"], before.numpy())
    assert np.shares_memory(res.tensors["a"], t.numpy())  # no copy on entry
    assert not res.tensors["a"].flags.writeable  # and the run cannot write into it


def test_inputs_converted_only_when_dtype_differs() -> None:
    g = Graph("copy")
    a, b = g.tensor("a", (4, 4)), g.tensor("b", (4, 4))
    g.linear_store(g.linear_load(a, (4, 4)), b)
    prog = g.build()
    f64 = np.eye(4)  # float64: converted to fp32 (a private array)
    res = run(prog, tensors={"a": f64})
    assert res.tensors["a"].dtype == np.float32 and not np.shares_memory(res.tensors["a"], f64)
    strided = np.arange(64, dtype=np.float32).reshape(8, 8)[::2, ::2]  # non-contiguous view
    res = run(prog, tensors={"a": strided})
    np.testing.assert_array_equal(res.tensors["b"], strided)
    assert np.shares_memory(res.tensors["a"], strided)


def test_given_output_tensor_is_not_written() -> None:
    g = Graph("copy")
    a, b = g.tensor("a", (4, 4)), g.tensor("b", (4, 8))
    g.linear_store(g.linear_load(a, (4, 4)), b, base=1)  # writes the right half only
    out = np.full((4, 8), -1.0, dtype=np.float32)
    x = np.ones((4, 4), dtype=np.float32)
    res = run(g.build(), tensors={"a": x, "b": out})
    assert (out == -1).all()
    np.testing.assert_array_equal(res.tensors["b"][:, :4], -1)
    np.testing.assert_array_equal(res.tensors["b"][:, 4:], 1)


def test_loaded_tiles_are_read_only_views(monkeypatch: pytest.MonkeyPatch) -> None:
    def double_in_place(f: object, x: np.ndarray) -> np.ndarray:
        x *= 2
        return x

    spec = FnSpec("double_in_place", "map", 1, lambda f, args: args[0], double_in_place)
    monkeypatch.setitem(_functions._REGISTRY, spec.name, spec)
    g = Graph("bad_fn")
    a = g.tensor("a", (4, 4))
    g.output("y", g.map("double_in_place", g.linear_load(a, (4, 4))))
    x = np.ones((4, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="read-only"):
        run(g.build(), tensors={"a": x})
    assert (x == 1).all()


def test_input_stream_tiles_are_read_only_and_not_copied() -> None:
    g = Graph("ident")
    x = g.input("x", TileType((2, 2)), (1, 2))
    g.output("y", g.map(fn("scale", alpha=1.0), x))
    tiles = [np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)]
    res = run(g.build(), streams={"x": [tiles]})
    got = res.values["x"].data[0]
    assert all(np.shares_memory(t, s) and not t.flags.writeable for t, s in zip(got, tiles))
    assert all(t.flags.writeable for t in tiles)  # the caller's arrays keep their flags


def test_tile_slice_unravels_row_major() -> None:
    arr = np.zeros((2, 3, 8, 6))
    grid = [2, 3, 4, 2]
    for lin in range(48):
        *lead, i, j = np.unravel_index(lin, grid)
        want = (*map(int, lead), slice(2 * i, 2 * i + 2), slice(3 * j, 3 * j + 3))
        assert tile_slice(arr, grid, lin, (2, 3), "t") == want
    with pytest.raises(StepRuntimeError, match="outside the 48 tiles"):
        tile_slice(arr, grid, 48, (2, 3), "t")


# ---------------------------------------------------------------- check=False


def test_moe_runs_without_checks_and_learns_partition_counts() -> None:
    E, k, H, I, T = 4, 2, 8, 4, 6  # noqa: E741
    routing = np.array([[0, 2], [2, 0], [2, 3], [0, 2], [2, 0], [3, 2]], dtype=np.int64)
    inputs = moe_inputs(num_experts=E, top_k=k, hidden=H, intermediate=I, tokens=T, routing=routing)
    prog = moe_graph(num_experts=E, top_k=k, hidden=H, intermediate=I, tile_h=4, tile_i=2)
    fast = run(prog, tensors=inputs, check=False)
    full = run(prog, tensors=inputs)
    np.testing.assert_array_equal(fast.tensors["out"], full.tensors["out"])
    assert [fast.bindings[f"moe_n{e}"] for e in range(E)] == [4, 0, 6, 2]
    assert fast.bindings == full.bindings
    assert metrics(prog).evaluate(fast.bindings)["offchip_bytes"] == fast.offchip_bytes


def test_partition_count_given_in_env_is_checked_without_checks() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B))
    s = g.input("s", SelectorType(2), (1, B))
    for k, o in enumerate(g.partition(x, s, 2, name="route")):
        g.output(f"o{k}", o)
    xs = [[np.full((1, 1), v, np.float32) for v in range(3)]]
    streams = {"x": xs, "s": [[sel(0), sel(0, 1), sel(1)]]}
    res = run(g.build(), streams=streams, check=False)
    assert (res.bindings["route_n0"], res.bindings["route_n1"]) == (2, 2)
    with pytest.raises(StepRuntimeError, match="route output 1 .*route_n1 = 5.* has 2"):
        run(g.build(), streams=streams, env={"route_n1": 5}, check=False)


def test_fresh_ragged_sizes_are_learnt_without_checks() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, B, RaggedDim("L", B)))
    s = g.input("s", SelectorType(2, 1), (1, B))
    o0, o1 = g.partition(x, s, 2, name="p")
    g.output("o0", o0)
    g.output("o1", o1)
    data = [[[np.ones((1, 1), np.float32)] * n for n in (3, 1, 2)]]
    streams = {"x": data, "s": [[sel(0), sel(1), sel(0)]]}
    res = run(g.build(), streams=streams, env={"L": [3, 1, 2]}, check=False)
    assert res.bindings["p0_r0"] == {(0,): 3, (1,): 2}
    assert res.bindings["p1_r0"] == {(0,): 1}


# ---------------------------------------------------------------- shared metric formulas


def test_metrics_per_signature_equal_rules_of_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    prog = moe_graph(num_experts=6, top_k=2, hidden=8, intermediate=4, tile_h=4, tile_i=2)
    direct = {op.name: node_metrics(op) for op in prog.nodes}
    calls = []

    def counted(op: object) -> dict:
        calls.append(op)
        return node_metrics(op)  # type: ignore[arg-type]

    monkeypatch.setattr(_metrics, "node_metrics", counted)
    m = metrics(prog)
    per_expert = sum(op.name.startswith("moe_e0_") for op in prog.nodes)
    assert len(calls) < len(prog.nodes) - 4 * per_expert  # experts 1..5 mostly renamed
    for name, row in direct.items():
        for key, expr in row.items():
            assert sp.srepr(m.by_node[name][key]) == sp.srepr(expr), (name, key)
    weights = 3 * 4 * 8 * 4  # w_gate + w_up + w_down of one expert, fp32
    experts = [sp.Piecewise((weights, sp.Gt(dyn(f"moe_n{e}"), 0)), (0, True)) for e in range(6)]
    assert m.offchip_read_bytes == (8 * 4 + 2 * 8 + 2 * 4) * dyn("T") + sp.Add(*experts)


def test_signature_ignores_names_and_keeps_shapes() -> None:
    g = Graph()
    n0, n1 = dyn("n0"), dyn("n1")
    a = g.input("a", TileType((n0, 4)), (1, 3))
    b = g.input("b", TileType((n1, 4)), (1, 3))
    c = g.input("c", TileType((n1, 8)), (1, 3))
    g.output("x", g.map("exp", a, name="x"))
    g.output("y", g.map("exp", b, name="y"))
    g.output("z", g.map("exp", c, name="z"))
    x, y, z = (signature(op) for op in g.build().nodes)
    assert x is not None and y is not None and z is not None
    assert x.key == y.key and x.key != z.key
    assert (x.symbols, y.symbols, x.names) == ((n0,), (n1,), frozenset({"x", "a"}))
    formulas = {"flops": 4 * n0 * 3}
    assert FormulaTemplate.of(formulas, x).rename(y) == {"flops": 12 * n1}  # type: ignore[union-attr]
    assert FormulaTemplate.of({"flops": dyn("x_r0")}, x) is None  # made from the node's name


def test_gated_max_over_equals_sympy_general_form() -> None:
    n = dyn("n")
    gate = sp.Piecewise((1, sp.Gt(n, 0)), (0, True))
    body = 2048 * n + 16
    general = sp.Piecewise((body, sp.Gt(gate, 0)), (0, True))  # sympy's inequality solver
    assert max_over(body, Index("_p0"), gate) == general == sp.Piecewise((body, n > 0), (0, True))
    assert MaxOver(body, Index("_p0"), sp.Integer(0)) == 0
