"""The SwiGLU Mixture-of-Experts layer as a STeP graph with dynamic tiling (STeP Fig. 2, §5.2).

``out[t] = sum_j topk_w[t, j] * down_e(act(gate_e x_t) * up_e x_t)``, ``e = topk_idx[t, j]``,
with PyTorch ``Linear`` layouts ``w_gate, w_up: [E, I, H]`` and ``w_down: [E, H, I]``.

Structure (one graph serves every routing: the router's choices are data read from
``topk_idx`` / ``topk_w``, turned into selectors inside the graph):

1. **Tokens and selectors.** ``x`` is read as one ``[1, H]`` row tile per token (``[1, T]``);
   ``topk_idx`` rows become k-hot selectors (``to_selector``), STeP §3.2.3.
2. **Partition** routes every token row to the ``k`` experts it chose (multi-hot, rank 0):
   expert ``e`` gets the stream ``[N_e]`` of its rows, ``N_e = {prefix}_n{e}`` a dynamic
   dimension.  A second Partition with the same selectors and count symbols carries each
   token's ``(ids, weights)`` to the same experts.
3. **Dynamic tiling** (§5.2: Fig. 2's first Reshape replaced by a Promote).  Promote gives
   ``[P_e, N_e]`` with ``P_e = 1 if N_e > 0 else 0``; Bufferize keeps the expert's rows in one
   dynamically sized on-chip buffer ``Buf[N_e]`` (STeP (revised) §3.2.2); for every ``tile_i``
   block of the intermediate dimension, Streamify reads the rows once and Accum(RetileRow)
   packs them into the expert's tile ``[N_e, H]`` (the tile *is* the set of its tokens),
   split into ``[N_e, tile_h]`` column blocks when ``tile_h < H``.  (Bufferize takes only
   statically sized tiles, STeP Table 3 ``Bufferize<S, ...>``: the buffer holds the
   ``[1, H]`` rows and the dynamic tile is packed again for each ``tile_i`` block.)
4. **Gate / up.** Weight tiles ``[tile_i, tile_h]`` are streamed from HBM by a
   LinearOffChipLoad whose reference is the expert's buffer stream, so an expert without
   tokens (``P_e = 0``, an empty stream, Revet §III-A) loads no weights at all.
   Accum(``matmul_t_acc``) sums over the ``H/tile_h`` blocks into ``[N_e, tile_i]``; the
   gated activation (``silu_mul``, ``gelu_mul``...) is a Map.
5. **Down.** Each ``[N_e, tile_i]`` block is repeated over the ``H/tile_h`` blocks of
   ``w_down`` tiles ``[tile_h, tile_i]``; Map(``matmul_t``) gives partial column blocks,
   Accum(``retile_col``) joins them into ``[N_e, H]`` and Accum(``add``) sums the
   ``I/tile_i`` partial products (one Accum(``matmul_t_acc``) when ``tile_h = H``).
6. **Routing weight.** ``pick_weight`` extracts the expert's weight of each token; the
   ``[N_e, 1]`` column (RetileRow) scales the expert's output tile.  The scaling happens
   inside the expert because Reassemble orders a token's ``k`` rows by arrival (STeP (revised)
   §3.2.3), not by choice index.
7. **Back to tokens.** FlatMap(RetileStreamify) splits the tile into rows; Reassemble with the
   same selectors gathers, for every token, its ``k`` expert rows (``[1, T, k]``); Accum(add)
   sums the choices and LinearOffChipStore writes ``out`` (every row).

Default tiles: a dimension of at most 256 is taken whole; a larger one is tiled by its largest
divisor not above 256 (256 for the Mixtral and Qwen3 widths).  Off-chip traffic is therefore
``|x| + |topk_idx| + |topk_w| + |out| + sum_e [N_e > 0] * 3 * I * H * itemsize``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy as sp
import torch

from torch2step.errors import StepTypeError
from torch2step.step import Graph, OffChipTensor, Program, Value, dyn, fn, zeros

from .moe_lanes import add_lanes, lane_experts

__all__ = ["ACTIVATIONS", "add_moe", "default_tile", "moe_graph", "moe_inputs", "moe_reference"]

ACTIVATIONS: dict[str, str] = {
    "silu": "silu_mul",
    "gelu": "gelu_mul",
    "gelu_tanh": "gelu_tanh_mul",
    "relu": "relu_mul",
}
"""Activation name -> the gated tile function ``act(gate) * up``."""

_TILE_CAP = 256


def default_tile(dim: int, cap: int = _TILE_CAP) -> int:
    """The whole dimension if ``dim <= cap``, else its largest divisor ``<= cap``."""
    if dim <= cap:
        return dim
    return max(d for d in range(1, cap + 1) if dim % d == 0)


def _static(t: OffChipTensor, axis: int, what: str) -> int:
    d = t.shape[axis]
    if not d.is_Integer:
        raise StepTypeError(f"add_moe: {what} ({t.name} axis {axis}) must be static, got {d}")
    return int(d)


def _check_shapes(
    x: OffChipTensor,
    topk_idx: OffChipTensor,
    topk_w: OffChipTensor,
    w_gate: OffChipTensor,
    w_up: OffChipTensor,
    w_down: OffChipTensor,
    out: OffChipTensor,
    num_experts: int,
    top_k: int,
) -> tuple[sp.Expr, int, int]:
    """``(T, H, I)`` after checking every tensor's shape and dtype against the layer."""
    if not 1 <= top_k <= num_experts:
        raise StepTypeError(f"add_moe: need 1 <= top_k <= num_experts, got {top_k}, {num_experts}")
    T, H = x.shape[0], _static(x, 1, "the hidden size H")
    I = _static(w_gate, 1, "the intermediate size I")  # noqa: E741 - the paper's name
    E, k = num_experts, top_k
    want = {
        x.name: (x, (T, H)),
        topk_idx.name: (topk_idx, (T, k)),
        topk_w.name: (topk_w, (T, k)),
        w_gate.name: (w_gate, (E, I, H)),
        w_up.name: (w_up, (E, I, H)),
        w_down.name: (w_down, (E, H, I)),
        out.name: (out, (T, H)),
    }
    for t, shape in want.values():
        got = t.shape
        if len(got) != len(shape) or any(sp.simplify(a - b) != 0 for a, b in zip(got, shape)):
            raise StepTypeError(
                f"add_moe: tensor {t} should have shape {list(shape)} "
                "(x/out [T, H], topk [T, k], w_gate/w_up [E, I, H], w_down [E, H, I])"
            )
    if topk_idx.dtype not in ("int32", "int64"):
        raise StepTypeError(f"add_moe: topk_idx must hold integer expert ids, got {topk_idx}")
    return T, H, I


def add_moe(
    g: Graph,
    *,
    x: OffChipTensor,
    topk_idx: OffChipTensor,
    topk_w: OffChipTensor,
    w_gate: OffChipTensor,
    w_up: OffChipTensor,
    w_down: OffChipTensor,
    out: OffChipTensor,
    num_experts: int,
    top_k: int,
    activation: str = "silu",
    tile_h: int | None = None,
    tile_i: int | None = None,
    prefix: str = "moe",
    lanes: int | None = None,
    static_tile: int | None = None,
    repeat_tile: bool = False,
    scale_in_lanes: bool = True,
    lane_assign: str = "consecutive",
) -> None:
    """Add the MoE layer to ``g`` (see the module docstring).

    ``static_tile=None`` tiles each expert's tokens dynamically (one tile of exactly its
    ``N_e`` tokens, STeP (arXiv 2511.07776) §5.2); ``static_tile=N`` is the static tiling the
    paper compares with: the expert's rows are cut into tiles of ``N`` (Reshape, the last tile
    padded with zero rows), every tile reads the expert's weights again, and the padded rows
    are dropped after the expert (FilterPadding), so the expert reads its weights
    ``ceil(N_e / N)`` times and computes on ``N * ceil(N_e / N)`` rows.  ``repeat_tile``: pack
    the expert's token tile once and repeat it for every ``tile_i`` block (the paper's Fig. 2
    and artifact: Accum(RetileRow) then Repeat) instead of re-streaming the rows from a buffer
    per block (step 3 above); it holds one ``[N_e, H]`` tile instead of the rows.

    ``lanes=None`` gives every expert its own branch; ``lanes=P`` configures ``P`` branches
    shared in time by ``E/P`` consecutive experts each (STeP (arXiv 2511.07776) §5.3,
    :mod:`.moe_lanes`); ``scale_in_lanes``: the routing weights scale each lane's output
    (default: no unit per expert) or, ``False``, each expert's rows after its lane (one unit
    per expert, as the paper's artifact builds its §5.3 graphs).  ``lane_assign``: which
    experts a lane serves: ``"consecutive"`` (``E/P`` consecutive experts per lane, the
    paper's §5.3 regions) or ``"dispatch"`` (every expert with tokens, in arrival order, to the
    next lane round-robin, so the lanes serve equal numbers of used experts whatever the
    routing; :mod:`.moe_lanes`).

    Every node is named ``{prefix}_...`` (tensors share the graph's namespace: keep their names
    outside it) and expert ``e``'s token count is the dynamic size ``{prefix}_n{e}`` (the
    Partition records it during a run).
    """
    T, H, I = _check_shapes(  # noqa: E741 - the paper's names
        x, topk_idx, topk_w, w_gate, w_up, w_down, out, num_experts, top_k
    )
    if activation not in ACTIVATIONS:
        raise StepTypeError(
            f"add_moe: unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}"
        )
    th = default_tile(H) if tile_h is None else tile_h
    ti = default_tile(I) if tile_i is None else tile_i
    if static_tile is not None and (not isinstance(static_tile, int) or static_tile < 1):
        raise StepTypeError(f"add_moe: static_tile must be a positive int or None, got {static_tile!r}")
    if th < 1 or H % th or ti < 1 or I % ti:
        raise StepTypeError(
            f"add_moe: tile_h={th} must divide H={H} and tile_i={ti} must divide I={I}"
        )
    E, p = num_experts, prefix
    counts = tuple(f"{p}_n{e}" for e in range(E))

    gather = lanes is not None and lane_assign == "dispatch"
    if gather:  # the lanes load their tokens' rows: only token indices are routed
        ids1 = g.linear_load(
            topk_idx, (1, top_k), out_shape=(1, T), stride=(0, 1), name=f"{p}_idx_ld"
        )  # [1, T]
        ids = g.flatten(ids1, 0, 1, name=f"{p}_idx")  # [T]
        rows = g.flatten(
            g.scan(ids1, fn("row_count"), fn("int_row", values=(-1,)), 1, name=f"{p}_tok1"),
            0,
            1,
            name=f"{p}_tok",
        )  # [T] of [1, 1]: each token's row index in x
    else:
        rows = g.linear_load(x, (1, H), out_shape=(T,), stride=(1,), name=f"{p}_x_ld")  # [T]
        ids = g.linear_load(
            topk_idx, (1, top_k), out_shape=(T,), stride=(1,), name=f"{p}_idx_ld"
        )
    wts = g.linear_load(topk_w, (1, top_k), out_shape=(T,), stride=(1,), name=f"{p}_w_ld")
    sel = g.map(fn("to_selector", n=E), ids, name=f"{p}_sel")  # [1, T] of Sel[E, k]
    plan = _Plan(
        H, I, th, ti, ACTIVATIONS[activation], p, x.dtype, static_tile, repeat_tile,
        scale_in_lanes, x if gather else None,
    )
    if lane_assign not in ("consecutive", "dispatch"):  # checked before any node is added
        raise StepTypeError(
            f"add_moe: lane_assign={lane_assign!r}; use 'consecutive' or 'dispatch'"
        )
    if lanes is not None and scale_in_lanes:
        lane_experts(E, lanes)  # checks 1 <= lanes <= E
        packed = g.zip(rows, ids, wts, name=f"{p}_xiw")
        routed = g.partition(packed, sel, E, count_names=counts, name=f"{p}_route")
        expert_rows = add_lanes(
            g, plan, routed, counts, (w_gate, w_up, w_down), lanes, lane_assign
        )
        _combine(g, expert_rows, sel, out, H, p)
        return
    routed = g.partition(rows, sel, E, count_names=counts, name=f"{p}_route")
    route_info = g.zip(ids, wts, name=f"{p}_idw")
    infos = g.partition(route_info, sel, E, count_names=counts, name=f"{p}_route_w")
    if lanes is not None:
        lane_experts(E, lanes)  # checks 1 <= lanes <= E
        lane_rows = add_lanes(
            g, plan, routed, counts, (w_gate, w_up, w_down), lanes, lane_assign
        )
        # the routing weight scales each expert's rows after its lane, one unit per expert,
        # as the artifact of STeP (arXiv 2511.07776) §5.3 does (its Stages 13-14)
        expert_rows = [
            g.map(
                "mul",
                g.zip(
                    lane_rows[e],
                    g.map(fn("pick_weight", expert=e), infos[e], name=f"{p}_e{e}_gw"),
                    name=f"{p}_e{e}_scale_in",
                ),
                name=f"{p}_e{e}_scaled",
            )
            for e in range(E)
        ]
        _combine(g, expert_rows, sel, out, H, p)
        return

    expert_rows = [
        _expert(g, plan, e, routed[e], infos[e], dyn(counts[e]), (w_gate, w_up, w_down))
        for e in range(E)
    ]
    _combine(g, expert_rows, sel, out, H, p)


def _combine(g: Graph, expert_rows: list[Value], sel: Value, out: OffChipTensor, H: int, p: str):
    """Step 7: Reassemble each token's ``k`` expert rows, sum them, store ``out``."""
    back = g.reassemble(expert_rows, sel, name=f"{p}_back")  # [1, T, k] of [1, H]
    total = g.accum(back, "add", zeros(1, H, out.dtype), 1, name=f"{p}_sum")  # [1, T]
    g.linear_store(total, out, name=f"{p}_store")


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every expert branch shares: sizes, tiles, gated function, name prefix, dtype."""

    H: int
    I: int  # noqa: E741 - the paper's name
    th: int
    ti: int
    act: str
    prefix: str
    dtype: str
    static: int | None = None
    repeat_tile: bool = False
    scale_in_lanes: bool = True
    gather: OffChipTensor | None = None  # lanes load token rows of this tensor by index


def _expert(
    g: Graph,
    plan: _Plan,
    e: int,
    rows: Value,
    info: Value,
    n_e: sp.Symbol,
    weights: tuple[OffChipTensor, OffChipTensor, OffChipTensor],
) -> Value:
    """Expert ``e``'s branch: its token rows ``[N_e]`` in, its scaled output rows out."""
    H, th, ti, dt = plan.H, plan.th, plan.ti, plan.dtype
    w_gate, w_up, w_down = weights
    nh, ni = H // th, plan.I // ti
    q = f"{plan.prefix}_e{e}"
    pad_flags = None
    if plan.static is None:
        tiles = g.promote(rows, name=f"{q}_tile")  # [P_e, N_e]
    else:  # static tiling: [C_e, N] rows, C_e = ceil(N_e / N), the last tile zero-padded
        n_e = sp.Integer(plan.static)
        tiles, pad_flags = g.reshape(rows, 0, plan.static, 0.0, name=f"{q}_tile")
    if plan.repeat_tile:  # Fig. 2: pack the tile once, repeat it per tile_i block
        buf = g.accum(tiles, "retile_row", zeros(0, H, dt), 1, name=f"{q}_xt0")  # [P_e] [N_e, H]
        xt = g.repeat(buf, ni, name=f"{q}_xt")  # [P_e, I/ti] of [N_e, H]
    else:  # keep the rows in a buffer and pack them again per tile_i block
        buf = g.bufferize(tiles, 1, name=f"{q}_buf")  # [P_e] Buf[N_e] / [C_e] Buf[N]
        per_i = g.repeat(buf, ni, name=f"{q}_per_i")  # [P_e, I/ti]
        again = g.streamify(buf, per_i, name=f"{q}_rows")  # [P_e, I/ti, N_e] of [1, H]
        xt = g.accum(again, "retile_row", zeros(0, H, dt), 1, name=f"{q}_xt")  # [N_e, H]
    xt = g.repeat(xt, 1, name=f"{q}_xt1")
    if nh > 1:
        xt = g.flat_map(xt, fn("split_cols", cols=th), name=f"{q}_xh")  # [.., H/th] [N_e, th]

    def gate_up(w: OffChipTensor, what: str) -> Value:
        wt = g.linear_load(
            w,
            (ti, th),
            ref=buf,
            out_shape=(ni, nh),
            stride=(nh, 1),
            base=e * ni * nh,
            name=f"{q}_{what}_w",
        )  # [P_e, I/ti, H/th] of [ti, th]
        pair = g.zip(xt, wt, name=f"{q}_{what}_in")
        return g.accum(
            pair, "matmul_t_acc", fn("zeros", shape=(n_e, ti), dtype=dt), 1, name=f"{q}_{what}"
        )

    gu = g.zip(gate_up(w_gate, "gate"), gate_up(w_up, "up"), name=f"{q}_act_in")
    h = g.map(plan.act, gu, name=f"{q}_act")
    wd = g.linear_load(
        w_down,
        (th, ti),
        ref=buf,
        out_shape=(ni, nh),
        stride=(1, ni),
        base=e * nh * ni,
        name=f"{q}_down_w",
    )  # [P_e, I/ti, H/th] of [th, ti]
    h_rep = g.repeat(h, nh, name=f"{q}_h_rep")  # [P_e, I/ti, H/th] of [N_e, ti]
    pair = g.zip(h_rep, wd, name=f"{q}_down_in")
    if nh == 1:
        y = g.accum(
            pair, "matmul_t_acc", fn("zeros", shape=(n_e, H), dtype=dt), 2, name=f"{q}_down"
        )
    else:
        part = g.map("matmul_t", pair, name=f"{q}_down_mm")  # [.., H/th] of [N_e, th]
        cols = g.accum(
            part, "retile_col", fn("zeros", shape=(n_e, 0), dtype=dt), 1, name=f"{q}_down_cat"
        )
        y = g.accum(
            cols, "add", fn("zeros", shape=(n_e, H), dtype=dt), 1, name=f"{q}_down"
        )  # [P_e]

    w_e = g.map(fn("pick_weight", expert=e), info, name=f"{q}_gw")  # [N_e] of [1, 1]
    info_dt = w_e.type.dtype.dtype  # type: ignore[attr-defined]
    if plan.static is None:
        w_tiles = g.promote(w_e, name=f"{q}_gw_tile")
    else:
        w_tiles = g.reshape(w_e, 0, plan.static, 0.0, name=f"{q}_gw_tile")[0]
    w_col = g.accum(
        w_tiles,
        "retile_row",
        zeros(0, 1, info_dt),
        1,
        name=f"{q}_gw_col",
    )  # [P_e] of [N_e, 1]
    scaled = g.map(
        "mul", g.zip(y, w_col, name=f"{q}_scale_in"), name=f"{q}_scaled"
    )  # [P_e] of [N_e, H]
    out = g.flat_map(scaled, fn("retile_streamify", rows=1), name=f"{q}_out")  # rows
    if pad_flags is None:
        return out
    flags = g.flatten(pad_flags, 0, 1, name=f"{q}_pad_flat")  # [C_e * N]
    kept = g.flat_map(g.zip(out, flags, name=f"{q}_pad_in"), "filter_padding", name=f"{q}_unpad")
    return kept  # [N_e] real rows


# ---------------------------------------------------------------- convenience


def moe_graph(
    *,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    tokens: int | sp.Expr | None = None,
    dtype: str = "fp32",
    **kw: object,
) -> Program:
    """A verified program holding only the MoE layer; tensors ``x, topk_idx, topk_w, w_gate,
    w_up, w_down, out``; ``tokens`` defaults to the dynamic size ``T``.  ``kw`` goes to
    :func:`add_moe` (``activation``, ``tile_h``, ``tile_i``, ``prefix``, ``lanes``)."""
    T = dyn("T") if tokens is None else tokens
    E, k, H, I = num_experts, top_k, hidden, intermediate  # noqa: E741
    g = Graph("moe")
    tensors = {
        "x": g.tensor("x", (T, H), dtype),
        "topk_idx": g.tensor("topk_idx", (T, k), "int64"),
        "topk_w": g.tensor("topk_w", (T, k), dtype),
        "w_gate": g.tensor("w_gate", (E, I, H), dtype),
        "w_up": g.tensor("w_up", (E, I, H), dtype),
        "w_down": g.tensor("w_down", (E, H, I), dtype),
        "out": g.tensor("out", (T, H), dtype),
    }
    add_moe(g, **tensors, num_experts=E, top_k=k, **kw)  # type: ignore[arg-type]
    return g.build()


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """``(tokens, top_k)`` int64 distinct expert ids per token, uniformly at random."""
    rng = np.random.default_rng(seed)
    return (
        np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])
        .astype(np.int64)
        .reshape(tokens, top_k)
    )


def moe_inputs(
    *,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    tokens: int,
    seed: int = 0,
    routing: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """Random fp32 inputs for :func:`moe_graph` / :func:`moe_reference` (``run(tensors=...)``).

    ``routing`` (``(tokens, top_k)`` expert ids, e.g. ``models.traces.routing(...)``) fixes the
    expert choices; otherwise they are random.  Routing weights are a softmax over the choices.
    Weights are scaled by ``1/sqrt(fan_in)`` so activations stay of order one.
    """
    E, k, H, I = num_experts, top_k, hidden, intermediate  # noqa: E741
    idx = random_routing(tokens, E, k, seed) if routing is None else np.asarray(routing)
    if idx.shape != (tokens, k):
        raise ValueError(f"moe_inputs: routing has shape {idx.shape}, expected {(tokens, k)}")
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(tokens, H, generator=gen),
        "topk_idx": torch.as_tensor(idx, dtype=torch.int64),
        "topk_w": torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1),
        "w_gate": torch.randn(E, I, H, generator=gen) / H**0.5,
        "w_up": torch.randn(E, I, H, generator=gen) / H**0.5,
        "w_down": torch.randn(E, H, I, generator=gen) / I**0.5,
    }


_TORCH_ACT = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
    "relu": torch.relu,
}


def moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The layer in plain PyTorch: a loop over the experts that have tokens."""
    act = _TORCH_ACT[activation]
    out = torch.zeros_like(x)
    for e in torch.unique(topk_idx).tolist():
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        xe = x[tok]
        ye = (act(xe @ w_gate[e].T) * (xe @ w_up[e].T)) @ w_down[e].T
        out.index_add_(0, tok, ye * topk_w[tok, slot, None])
    return out
