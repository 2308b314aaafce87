"""Seed 000 §4.1 metrics: closed-form formulas and formula == measured on real runs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy as sp

from torch2step.step import (
    ADDR,
    Graph,
    Index,
    RaggedDim,
    RunResult,
    SelectorType,
    TileType,
    dyn,
    fn,
    metrics,
    offchip_traffic,
    onchip_memory,
    sel,
    total_flops,
    zeros,
)

i = Index("i")


def test_tiled_matmul_formulas(
    checked_run: Callable[..., RunResult], rng: np.random.Generator
) -> None:
    M = dyn("M", positive=True)
    g = Graph("mm")
    a = g.tensor("a", (16 * M, 64))
    b = g.tensor("b", (64, 32))
    c = g.tensor("c", (16 * M, 32))
    a_buf = g.bufferize(g.linear_load(a, (16, 32)), 1)
    b_t = g.linear_load(b, (32, 32), ref=a_buf, out_shape=(2,), stride=(1,))
    prod = g.map("matmul", g.streamify(a_buf, a_buf), b_t)
    g.linear_store(g.accum(prod, "add", zeros(16, 32), 1), c)
    prog = g.build()
    # A once (8 KiB per row block), B once per row block (8 KiB), C once (2 KiB)
    assert offchip_traffic(prog) == 14336 * M
    # 2x staging of A, B, C tiles + Bufferize (2 KiB + 2x4 KiB) + matmul scratch + accumulator
    assert onchip_memory(prog) == 34816
    assert total_flops(prog) == 66560 * M
    A = rng.standard_normal((48, 64)).astype(np.float32)
    B = rng.standard_normal((64, 32)).astype(np.float32)
    res = checked_run(prog, tensors={"a": A, "b": B})
    assert np.allclose(res.tensors["c"], A @ B, atol=1e-4)
    assert res.offchip_bytes == 14336 * 3
    assert metrics(prog).evaluate(M=3)["operational_intensity"] == 66560 / 14336


def _gqa(B: sp.Symbol) -> Graph:
    G, D, T, LMAX = 4, 8, 4, 3
    g = Graph("gqa")
    q = g.tensor("q", (B * G, D))
    k = g.tensor("k", (B * LMAX * T, D))
    v = g.tensor("v", (B * LMAX * T, D))
    o = g.tensor("o", (B * G, D))
    addr = g.input("addr", ADDR, (1, B, RaggedDim("Lt", B)))
    kt, vt = g.random_load(addr, k, (T, D)), g.random_load(addr, v, (T, D))
    qe = g.expand(g.linear_load(q, (G, D)), kt, 0)
    state = g.accum(
        g.zip(qe, kt, vt),
        fn("online_softmax", scale=0.5),
        fn("online_softmax_init", rows=G, cols=D),
        1,
    )
    g.linear_store(g.map("softmax_finalize", state), o)
    return g


def test_gqa_ragged_kv_traffic(
    checked_run: Callable[..., RunResult], rng: np.random.Generator
) -> None:
    B = dyn("B")
    Lt = sp.IndexedBase("Lt")
    prog = _gqa(B).build()
    total = sp.Sum(Lt[i], (i, 0, B - 1))
    assert offchip_traffic(prog) == 256 * B + 256 * total  # q + o, and K + V tiles per request
    assert total_flops(prog) == 32 * B + 640 * total
    lens = [2, 0, 3, 1]
    Q = rng.standard_normal((16, 8)).astype(np.float32)
    K = rng.standard_normal((48, 8)).astype(np.float32)
    V = rng.standard_normal((48, 8)).astype(np.float32)
    addrs = [[[np.array([[3 * b + j]]) for j in range(n)] for b, n in enumerate(lens)]]
    res = checked_run(
        prog, tensors={"q": Q, "k": K, "v": V}, streams={"addr": addrs}, env={"Lt": lens}
    )
    assert res.offchip_bytes == 256 * 4 + 256 * 6
    for b, n in enumerate(lens):
        if n == 0:
            continue
        s = Q[4 * b : 4 * b + 4] @ K[12 * b : 12 * b + 4 * n].T * 0.5
        p = np.exp(s - s.max(1, keepdims=True))
        ref = (p / p.sum(1, keepdims=True)) @ V[12 * b : 12 * b + 4 * n]
        assert np.allclose(res.tensors["o"][4 * b : 4 * b + 4], ref, atol=1e-5)


def test_moe_dynamic_tiling_loads_weights_only_for_used_experts(
    checked_run: Callable[..., RunResult], rng: np.random.Generator
) -> None:
    """seed 000 §5.2: tokens per expert gathered into one dynamically sized tile."""
    B, H, E = dyn("B"), 8, 3
    g = Graph("moe")
    x = g.tensor("x", (B, H))
    w = [g.tensor(f"w{e}", (H, H)) for e in range(E)]
    y = g.tensor("y", (B, H))
    route = g.input("route", SelectorType(E, 2), (1, B))
    tokens = g.flatten(g.linear_load(x, (1, H)), 0, 1)
    outs = []
    for e, part in enumerate(g.partition(tokens, route, E, name="part")):
        tile = g.accum(g.promote(part), "retile_row", zeros(0, H), 1)  # [P] of [n_e, H]
        wt = g.linear_load(w[e], (H, H), ref=tile, out_shape=(1,), stride=(1,))
        h = g.flatten(g.map("matmul", g.repeat(tile, 1), wt), 0, 1)
        outs.append(g.flat_map(h, fn("retile_streamify", rows=1)))
    summed = g.accum(g.reassemble(outs, route), "add", zeros(1, H), 1)
    g.linear_store(summed, y)
    prog = g.build()
    n = [sp.Symbol(f"part_n{e}", integer=True, nonnegative=True) for e in range(E)]
    expect = 64 * B + sum(sp.Piecewise((256, n[e] > 0), (0, True)) for e in range(E))
    assert sp.simplify(offchip_traffic(prog) - expect) == 0
    X = rng.standard_normal((4, H)).astype(np.float32)
    W = [rng.standard_normal((H, H)).astype(np.float32) for _ in range(E)]
    routes = [sel(0, 1), sel(0, 1), sel(1, 0), sel(0, 1)]  # expert 2 gets no token
    res = checked_run(
        prog,
        tensors={"x": X, **{f"w{e}": W[e] for e in range(E)}},
        streams={"route": [routes]},
    )
    assert [res.bindings[f"part_n{e}"] for e in range(E)] == [4, 4, 0]
    assert res.offchip_bytes == 64 * 4 + 2 * 256
    assert np.allclose(res.tensors["y"], X @ W[0] + X @ W[1], atol=1e-5)


def test_metrics_by_node_and_totals() -> None:
    B = dyn("B")
    m = metrics(_gqa(B).build())
    assert set(m.by_node) == {
        "rload0",
        "rload1",
        "load0",
        "expand0",
        "zip0",
        "accum0",
        "map0",
        "store0",
    }
    assert m.by_node["rload0"]["offchip_read_bytes"] == 128 * sp.Sum(
        sp.IndexedBase("Lt")[i], (i, 0, B - 1)
    )
    row = m.evaluate_by_node({"B": 2, "Lt": [1, 2]})["accum0"]
    # accumulator state (16 + 16 + 128 bytes) + scratch 16*8*4 + K and V tiles
    assert row["onchip_bytes"] == 160 + 512 + 128 + 128


def test_moe_swiglu_expert_with_dynamic_buffer(
    checked_run: Callable[..., RunResult], rng: np.random.Generator
) -> None:
    """Per expert: the routed rows live in one dynamically sized on-chip buffer, streamed once
    per weight tile and packed into a dynamic tile; the down projection accumulates into a
    dynamic accumulator; rows go back to their tokens through Reassemble."""
    B, H, INTER, E = dyn("B"), 8, 8, 2
    g = Graph("swiglu_moe")
    x = g.tensor("x", (B, H))
    y = g.tensor("y", (B, H))
    w1 = [g.tensor(f"w1_{e}", (H, INTER)) for e in range(E)]
    w3 = [g.tensor(f"w3_{e}", (H, INTER)) for e in range(E)]
    w2 = [g.tensor(f"w2_{e}", (INTER, H)) for e in range(E)]
    route = g.input("route", SelectorType(E, 1), (1, B))
    tokens = g.flatten(g.linear_load(x, (1, H)), 0, 1)
    outs = []
    for e, part in enumerate(g.partition(tokens, route, E, count_names=("n0", "n1"))):
        n_e = dyn(f"n{e}")
        buf = g.bufferize(g.promote(part), 1)  # [P] of Buf[n_e] (dynamic buffer)
        g1 = g.linear_load(w1[e], (H, 4), ref=buf, out_shape=(2,), stride=(1,))
        g3 = g.linear_load(w3[e], (H, 4), ref=buf, out_shape=(2,), stride=(1,))
        d2 = g.linear_load(w2[e], (4, H), ref=buf, out_shape=(2,), stride=(1,))
        rows = g.streamify(buf, g1)  # [P, 2, n_e]: the rows once per weight tile
        xt = g.accum(rows, "retile_row", zeros(0, H), 1)  # [P, 2] of [n_e, H]
        h = g.map("silu_mul", g.map("matmul", xt, g1), g.map("matmul", xt, g3))
        out = g.accum(g.zip(h, d2), "matmul_acc", fn("zeros", shape=(n_e, H)), 1)
        assert out.type.dtype == TileType((n_e, H))
        outs.append(g.flat_map(out, fn("retile_streamify", rows=1)))
    merged = g.reassemble(outs, route)  # [1, B, 1]
    g.linear_store(g.flatten(merged, 0, 1), y)
    prog = g.build()
    X = rng.standard_normal((5, H)).astype(np.float32)
    W1 = [rng.standard_normal((H, INTER)).astype(np.float32) for _ in range(E)]
    W3 = [rng.standard_normal((H, INTER)).astype(np.float32) for _ in range(E)]
    W2 = [rng.standard_normal((INTER, H)).astype(np.float32) for _ in range(E)]
    choice = [1, 0, 1, 1, 0]
    tensors = {"x": X}
    for e in range(E):
        tensors.update({f"w1_{e}": W1[e], f"w3_{e}": W3[e], f"w2_{e}": W2[e]})
    res = checked_run(prog, tensors=tensors, streams={"route": [[sel(c) for c in choice]]})

    def swiglu(v: np.ndarray, e: int) -> np.ndarray:
        a, b = v @ W1[e], v @ W3[e]
        return (a / (1 + np.exp(-a)) * b) @ W2[e]

    expect = np.stack([swiglu(X[t], choice[t]) for t in range(5)])
    assert np.allclose(res.tensors["y"], expect, atol=1e-4)
    assert (res.bindings["n0"], res.bindings["n1"]) == (2, 3)
    # x, y once; each used expert's three weight matrices once
    assert res.offchip_bytes == 2 * 5 * H * 4 + 2 * 3 * H * INTER * 4
