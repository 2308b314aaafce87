"""STeP graphs (and their reference runs) used by the spatial tests and the scale benchmark.

Every builder returns ``(program, run_result)``; the run is the reference interpreter's on
deterministic inputs, which is what :func:`torch2step.spatial.simulate_graph` needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from torch2step.step import (
    Graph,
    SelectorType,
    dyn,
    fn,
    run,
    sel,
    zeros,
)
from torch2step.step import fn_library_models as _models  # noqa: F401  (registers to_selector)

__all__ = [
    "load_store",
    "map_chain",
    "two_stage",
    "routed",
    "regroup",
    "tiled_matmul",
    "moe",
    "moe_selectors",
]


def _rand(shape: Sequence[int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np.float32)


def load_store(tiles: int, tile: tuple[int, int] = (16, 16), dtype: str = "bf16") -> tuple:
    """``LinearOffChipLoad`` of ``tiles`` tiles of tensor ``a`` straight into a
    ``LinearOffChipStore`` of tensor ``o``."""
    r, c = tile
    g = Graph("load_store")
    a = g.tensor("a", (r * tiles, c), dtype)
    o = g.tensor("o", (r * tiles, c), dtype)
    g.linear_store(g.linear_load(a, tile, name="ld"), o, name="st")
    prog = g.build()
    return prog, run(prog, tensors={"a": _rand((r * tiles, c))})


def map_chain(
    tiles: int, fns: Sequence[str], tile: tuple[int, int] = (16, 16), dtype: str = "bf16"
) -> tuple:
    """load ``a`` -> Map(f) for each ``f`` in ``fns`` -> store ``o`` (nodes ``m0``, ``m1``...)."""
    r, c = tile
    g = Graph("map_chain")
    a = g.tensor("a", (r * tiles, c), dtype)
    o = g.tensor("o", (r * tiles, c), dtype)
    x = g.linear_load(a, tile, name="ld")
    for k, f in enumerate(fns):
        x = g.map(f, x, name=f"m{k}")
    g.linear_store(x, o, name="st")
    prog = g.build()
    return prog, run(prog, tensors={"a": _rand((r * tiles, c))})


def two_stage(
    tiles: int, tile: tuple[int, int] = (16, 16), dtype: str = "bf16", chained: bool = True
) -> tuple:
    """Two sub-programs chained through HBM: load ``a`` -> exp -> store ``t``; load ``t`` ->
    exp -> store ``o`` (nodes ``ld1 m1 st1 ld2 m2 st2``).  ``chained=False``: the second one
    loads another input ``b`` instead of ``t``."""
    r, c = tile
    g = Graph("two_stage")
    a = g.tensor("a", (r * tiles, c), dtype)
    t = g.tensor("t", (r * tiles, c), dtype)
    o = g.tensor("o", (r * tiles, c), dtype)
    src = t if chained else g.tensor("b", (r * tiles, c), dtype)
    g.linear_store(g.map("exp", g.linear_load(a, tile, name="ld1"), name="m1"), t, name="st1")
    g.linear_store(g.map("exp", g.linear_load(src, tile, name="ld2"), name="m2"), o, name="st2")
    prog = g.build()
    tensors = {"a": _rand((r * tiles, c)) * 0.1}
    if not chained:
        tensors["b"] = _rand((r * tiles, c), 1) * 0.1
    return prog, run(prog, tensors=tensors)


def routed(choices: Sequence[int], branches: int = 2, per_token: int = 4) -> tuple:
    """Tokens (``per_token`` 16x16 tiles each) partitioned by a *data* selector stream (one
    expert per token, ``choices[i]``) into ``branches`` branches; branch ``e`` multiplies its
    tiles by itself ``e + 1`` times (so branches differ in cost), and the branches are merged
    back in token order by Reassemble and stored."""
    n = len(choices)
    g = Graph("routed")
    a = g.tensor("a", (16 * n, 16 * per_token), "bf16")
    o = g.tensor("o", (16 * n, 16 * per_token), "bf16")
    x = g.linear_load(a, (16, 16), name="ld")  # [1, n, per_token]
    s = g.input("s", SelectorType(branches, 1), (1, n))
    outs = []
    for e, part in enumerate(g.partition(x, s, branches, name="route")):
        y = part
        for k in range(e + 1):
            y = g.map("mul", y, y, name=f"b{e}_m{k}")
        outs.append(y)
    g.linear_store(g.reassemble(outs, s, name="merge"), o, name="st")
    prog = g.build()
    sels = [[sel(int(c)) for c in choices]]
    data = _rand((16 * n, 16 * per_token)) * 0.5
    return prog, run(prog, tensors={"a": data}, streams={"s": sels})


def regroup(choices: Sequence[int], branches: int = 2) -> tuple:
    """The MoE routing pattern in miniature: a selector stream *computed on the fabric*
    (``to_selector`` of loaded ids, node ``sel``) feeds both a Partition and the Reassemble
    that puts the branches back in token order.  Each branch packs all its 16x16 token tiles
    into one tile (RetileRow) before splitting them again (RetileStreamify), so it emits
    nothing until its last token arrived."""
    n = len(choices)
    g = Graph("regroup")
    a = g.tensor("a", (16 * n, 16), "bf16")
    ids_t = g.tensor("ids", (n, 1), "int64")
    o = g.tensor("o", (16 * n, 16), "bf16")
    x = g.linear_load(a, (16, 16), out_shape=(n,), stride=(1,), name="ld")  # [1, n]
    ids = g.linear_load(ids_t, (1, 1), out_shape=(n,), stride=(1,), name="ld_ids")
    s = g.map(fn("to_selector", n=branches), ids, name="sel")
    outs = []
    for e, part in enumerate(g.partition(x, s, branches, name="route")):
        packed = g.accum(g.promote(part), "retile_row", zeros(0, 16, "bf16"), 1, name=f"pack{e}")
        outs.append(g.flat_map(packed, fn("retile_streamify", rows=16), name=f"unpack{e}"))
    g.linear_store(g.reassemble(outs, s, name="merge"), o, name="st")
    prog = g.build()
    tensors = {"a": _rand((16 * n, 16)), "ids": np.array(choices, np.int64).reshape(n, 1)}
    return prog, run(prog, tensors=tensors)


def tiled_matmul(m: int, k: int, n: int, tile: int = 64, dtype: str = "bf16") -> tuple:
    """``C = A @ B`` for ``A: [m, k]``, ``B: [k, n]`` in ``tile x tile`` tiles: each row block
    of A is buffered once and streamed once per column block of B; B is reloaded per row block;
    ``matmul_acc`` reduces over K (``(m/t) * (n/t) * (k/t)`` tile products)."""
    kt, nt = k // tile, n // tile
    g = Graph("tiled_matmul")
    a = g.tensor("a", (m, k), dtype)
    b = g.tensor("b", (k, n), dtype)
    c = g.tensor("c", (m, n), dtype)
    a_t = g.linear_load(a, (tile, tile), name="ld_a")  # [1, mt, kt]
    a_buf = g.bufferize(a_t, 1, name="buf_a")  # [1, mt]
    a_ref = g.repeat(a_buf, nt, name="rep_a")  # [1, mt, nt]
    a_s = g.streamify(a_buf, a_ref, name="strm_a")  # [1, mt, nt, kt]
    # per row block, B's tiles column block by column block: tile (k, j) is k * nt + j
    b_t = g.linear_load(b, (tile, tile), a_buf, out_shape=(nt, kt), stride=(1, nt), name="ld_b")
    prod = g.accum(g.zip(a_s, b_t), "matmul_acc", zeros(tile, tile, dtype), 1, name="mm")
    g.linear_store(prod, c, name="st")
    prog = g.build()
    return prog, run(prog, tensors={"a": _rand((m, k)), "b": _rand((k, n), 1)})


def _zeros(rows: object, cols: int, dtype: str) -> object:
    return fn("zeros", shape=(rows, cols), dtype=dtype)


def moe_selectors(tokens: int, experts: int, top_k: int, seed: int = 0) -> list:
    """A deterministic routing: token ``i`` picks ``top_k`` distinct experts at random."""
    rng = np.random.default_rng(seed)
    return [
        [sel(*sorted(rng.choice(experts, top_k, replace=False).tolist())) for _ in range(tokens)]
    ]


def moe(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    *,
    kt: int = 256,
    nt: int = 64,
    selectors: list | None = None,
    dtype: str = "bf16",
    weights: bool = True,
) -> tuple:
    """A SwiGLU MoE block in STeP with dynamic tiling (seed 000 Fig. 2): token rows are
    partitioned to experts by a data selector stream; each expert packs its ``n`` tokens into
    one ``[n, hidden]`` tile (RetileRow), streams its ``kt``-column pieces once per ``nt``-column
    block of ``W1``/``W3`` (``matmul_acc`` over K), applies SiLU-multiply, packs the result into
    one ``[n, inter]`` tile (transpose, RetileRow, transpose), streams its ``nt``-column pieces
    once per ``kt``-column block of ``W2`` and writes its output rows to its own tensor
    ``y{e}``.  Weights are stored pre-tiled in the order they are streamed.  An expert that
    receives no token loads no weight.  ``weights=False`` leaves the weights zero (cheap at
    full size; timing does not depend on values)."""
    g = Graph("moe")
    x = g.tensor("x", (tokens, hidden), dtype)
    tok = g.linear_load(x, (1, hidden), name="tok")  # [1, T, 1]
    s = g.input("s", SelectorType(experts, top_k), (1, tokens))
    ki, ni = hidden // kt, inter // nt  # W1/W3: ni column blocks of ki [kt, nt] tiles
    k2, n2 = inter // nt, hidden // kt  # W2: n2 column blocks of k2 [nt, kt] tiles
    tensors = {"x": _rand((tokens, hidden)) * 0.1}
    for e, part in enumerate(g.partition(tok, s, experts, name="route")):
        n_e = dyn(f"route_n{e}")  # tokens routed to expert e
        rows = g.promote(g.flatten(part, 0, 1))  # [P, n]; P = 1 if n > 0 else 0
        packed = g.accum(rows, "retile_row", zeros(0, hidden, dtype), 1, name=f"pack{e}")
        xrep = g.repeat(packed, ni, name=f"xrep{e}")  # [P, ni] of [n, hidden]
        xs = g.flat_map(xrep, fn("split_cols", cols=kt), name=f"xsplit{e}")  # [P, ni * ki]
        xs, _ = g.reshape(xs, 0, ki)  # [P, ni, ki] of [n, kt]
        hs = []
        for w in ("w1", "w3"):
            wt = g.tensor(f"{w}_{e}", (ni * ki * kt, nt), dtype)
            if weights:
                tensors[wt.name] = _rand((ni * ki * kt, nt), 2 * e + (w == "w3")) * 0.05
            w_t = g.linear_load(
                wt, (kt, nt), packed, out_shape=(ni, ki), stride=(ki, 1), name=f"ld_{w}_{e}"
            )
            hs.append(
                g.accum(g.zip(xs, w_t), "matmul_acc", _zeros(n_e, nt, dtype), 1, name=f"{w}mm{e}")
            )
        h = g.map("silu_mul", *hs, name=f"act{e}")  # [P, ni] of [n, nt]
        ht = g.map("transpose", h, name=f"tr{e}")  # [P, ni] of [nt, n]
        hp = g.accum(ht, "retile_row", _zeros(0, n_e, dtype), 1, name=f"hpack{e}")  # [P]
        hrow = g.map("transpose", hp, name=f"untr{e}")  # [P] of [n, inter]
        hrep = g.repeat(hrow, n2, name=f"hrep{e}")  # [P, n2]
        hsplit = g.flat_map(hrep, fn("split_cols", cols=nt), name=f"hsplit{e}")
        hsplit, _ = g.reshape(hsplit, 0, k2)  # [P, n2, k2] of [n, nt]
        w2 = g.tensor(f"w2_{e}", (n2 * k2 * nt, kt), dtype)
        if weights:
            tensors[w2.name] = _rand((n2 * k2 * nt, kt), 1000 + e) * 0.05
        w2_t = g.linear_load(
            w2, (nt, kt), packed, out_shape=(n2, k2), stride=(k2, 1), name=f"ld_w2_{e}"
        )
        out = g.accum(g.zip(hsplit, w2_t), "matmul_acc", _zeros(n_e, kt, dtype), 1, name=f"w2mm{e}")
        rows_out = g.flat_map(out, fn("retile_streamify", rows=1), name=f"unpack{e}")
        y = g.tensor(f"y{e}", (tokens * n2, kt), dtype)
        g.linear_store(rows_out, y, name=f"st{e}")
    prog = g.build()
    sels = selectors if selectors is not None else moe_selectors(tokens, experts, top_k)
    return prog, run(prog, tensors=tensors, streams={"s": sels})
