"""General tensor operators lower to STeP and run equal to PyTorch on random shapes
(hypothesis): batched matmul with broadcast batch dims, concatenation / split / slice /
index_select along any dimension, and any permutation (transposes that move the last
dimension included), each with the §4.1 off-chip traffic formula equal to the interpreter's
count."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph
from torch2step.layers.ops import TensorType
from torch2step.lower import lower
from torch2step.step import metrics, run

SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=4)


def _check(ops: list[tuple[L.LayerOp, list[str]]], inputs: dict[str, torch.Tensor], want) -> None:
    """Build a layer graph of ``ops`` over ``inputs``, lower it, run it and compare."""
    g = LayerGraph(name="g")
    for name, t in inputs.items():
        g.add_input(name, TensorType(tuple(t.shape), "int64" if t.dtype == torch.int64 else "fp32"))
    outs = []
    for op, args in ops:
        outs += g.add(op, args)
    g.outputs, g.single_output = outs, len(outs) == 1
    lw = lower(g)
    xs = list(inputs.values())
    tensors, env = lw.feed(xs)
    res = run(lw.program, tensors=tensors, env=env)
    got = lw.outputs(res.tensors, xs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert metrics(lw.program).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes


@settings(max_examples=25, deadline=None)
@given(
    batch=st.lists(st.tuples(st.integers(1, 3), st.sampled_from(["both", "a1", "b1", "bnone"])),
                   max_size=2),
    m=st.integers(1, 5), k=st.integers(1, 6), n=st.integers(1, 6), seed=st.integers(0, 99),
)  # fmt: skip
def test_batched_matmul_with_broadcast(batch, m, k, n, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    ab = [1 if how == "a1" else s for s, how in batch]
    bb = [1 if how == "b1" else s for s, how in batch]
    if all(how == "bnone" for _, how in batch):
        bb = []  # b has no batch dims: broadcast along all of a's
    a = torch.randn(*ab, m, k, generator=g)
    b = torch.randn(*bb, k, n, generator=g)
    _check([(L.MatMul(), ["a", "b"])], {"a": a, "b": b}, [a @ b])


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, dim=st.integers(0, 3), sizes=st.lists(st.integers(1, 4), min_size=1,
       max_size=3), seed=st.integers(0, 99))  # fmt: skip
def test_concat_along_any_dim(shape, dim, sizes, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    d = dim % len(shape)
    xs = {}
    for i, s in enumerate(sizes):
        shp = list(shape)
        shp[d] = s
        xs[f"x{i}"] = torch.randn(*shp, generator=g)
    _check([(L.Concat(d), list(xs))], xs, [torch.cat(list(xs.values()), d)])


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, dim=st.integers(0, 3), cuts=st.lists(st.integers(0, 4), max_size=3),
       seed=st.integers(0, 99))  # fmt: skip
def test_split_and_slice_along_any_dim(shape, dim, cuts, seed) -> None:
    """``torch.split`` into slices at sorted cut points (every slice non-empty)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    d = dim % len(shape)
    bounds = sorted({0, shape[d], *(c for c in cuts if 0 < c < shape[d])})
    ops = [(L.Slice(d, lo, hi), ["x"]) for lo, hi in zip(bounds, bounds[1:])]
    _check(ops, {"x": x}, list(torch.split(x, [hi - lo for lo, hi in zip(bounds, bounds[1:])], d)))


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, dim=st.integers(0, 3), count=st.integers(1, 5), seed=st.integers(0, 99))
def test_index_select_along_any_dim(shape, dim, count, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    d = dim % len(shape)
    x = torch.randn(*shape, generator=g)
    idx = torch.randint(0, shape[d], (count,), generator=g)
    _check([(L.Gather(d), ["x", "i"])], {"x": x, "i": idx}, [x.index_select(d, idx)])


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=4), data=st.data())
def test_any_permutation(shape, data) -> None:
    dims = tuple(data.draw(st.permutations(range(len(shape)))))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    _check([(L.Permute(dims), ["x"])], {"x": x}, [x.permute(dims).contiguous()])


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(2, 9), seed=st.integers(0, 99))
def test_dynamic_widths_move_elements(rows, length, seed) -> None:
    """A last dim of run-time size ``L``: concatenation, a slice to ``L - 1`` and a transpose,
    from one lowering for every ``L``."""
    import sympy

    L_ = sympy.Symbol("L", positive=True, integer=True)
    g = LayerGraph(name="dyn")
    g.add_input("x", TensorType((rows, L_), "fp32"))
    g.add_input("y", TensorType((rows, 3), "fp32"))
    (c,) = g.add(L.Concat(-1), ["x", "y"])
    (s,) = g.add(L.Slice(1, 1, L_), ["x"])
    (t,) = g.add(L.Permute((1, 0)), ["x"])
    g.outputs = [c, s, t]
    lw = lower(g)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, length, generator=gen), torch.randn(rows, 3, generator=gen)]
    tensors, env = lw.feed(xs)
    res = run(lw.program, tensors=tensors, env=env)
    want = (torch.cat(xs, -1), xs[0][:, 1:], xs[0].T)
    for a, b in zip(lw.outputs(res.tensors, xs), want):
        torch.testing.assert_close(a, b)
    assert metrics(lw.program).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
