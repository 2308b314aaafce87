"""The MoE router, the routed experts and attention (STeP (arXiv 2511.07776) §5).

The router is one ``Map(topk_route)`` per token row producing the routing weights and expert
ids, stored to HBM; the experts read them back as *data*: ``add_moe`` builds selectors from
the ids at run time, so one program serves every routing.  Attention is ``add_gqa_decode``
(one query token) or ``add_gqa_prefill`` (several): each request's KV rows are read at
dynamic addresses over its ragged length, with an online-softmax ``Accum``.
"""

from __future__ import annotations

import numpy as np
import sympy as sp

from torch2step.layers import ops as L
from torch2step.layers.graph import Node
from torch2step.step import fn

from .context import ATTN_LANES, LowerCtx, default_moe_lanes
from .rules_index import concrete

__all__ = ["lower_attention", "lower_moe", "lower_topk"]


def lower_topk(ctx: LowerCtx, n: Node) -> None:
    """``(weights, ids) = TopKRouting(logits)``: a per-row router map, two stores."""
    op = n.op
    assert isinstance(op, L.TopKRouting)
    rows = ctx.load_rows(n.inputs[0])
    f = fn("topk_route", k=op.k, softmax_first=op.softmax_first, normalize=op.normalize)
    both = ctx.graph.map(f, rows)
    ctx.store_rows(ctx.graph.map(fn("get", index=0), both), n.outputs[0])
    ctx.store_rows(ctx.graph.map(fn("get", index=1), both), n.outputs[1])


def lower_moe(ctx: LowerCtx, n: Node) -> None:
    """Routed SwiGLU experts via :func:`torch2step.lower.blocks.moe.add_moe`."""
    from torch2step.lower.blocks.moe import add_moe

    op = n.op
    assert isinstance(op, L.MoEExperts)
    if not op.gated or op.bias:
        what = " and ".join(
            s for s, on in (("a plain two-matrix MLP", not op.gated), ("biases", op.bias)) if on
        )
        raise ctx.fail(
            f"MoE experts with {what} have no STeP lowering yet: experts must be "
            "down(act(gate x) * up x) without biases to lower (the layer graph and "
            "torch2step.layers.evaluate support them)"
        )
    x, w, e, gate, up, down = n.inputs
    t_rows, hidden = ctx.rc(x)
    k = op.top_k
    kw = {}
    if ctx.options.moe_tile_h is not None:
        kw["tile_h"] = ctx.options.moe_tile_h
    if ctx.options.moe_tile_i is not None:
        kw["tile_i"] = ctx.options.moe_tile_i
    lanes = ctx.options.moe_lanes
    if lanes is None:
        lanes = default_moe_lanes(op.num_experts)
    if 0 < lanes < op.num_experts:
        kw["lanes"] = lanes
        kw["lane_assign"] = ctx.options.moe_lane_assign
    if ctx.options.moe_static_tile is not None:  # also inside shared regions (STeP §5.3)
        kw["static_tile"] = int(ctx.options.moe_static_tile)
    add_moe(
        ctx.graph,
        x=ctx.tensor_as(x, (t_rows, hidden)),
        topk_idx=ctx.tensor_as(e, (t_rows, k)),
        topk_w=ctx.tensor_as(w, (t_rows, k)),
        w_gate=ctx.tensor_as(gate, ctx.shape(gate)),
        w_up=ctx.tensor_as(up, ctx.shape(up)),
        w_down=ctx.tensor_as(down, ctx.shape(down)),
        out=ctx.declare(n.outputs[0]),
        num_experts=op.num_experts,
        top_k=k,
        activation=op.activation,
        prefix=ctx.prefix(),
        **kw,
    )


def lower_attention(ctx: LowerCtx, n: Node) -> None:
    """GQA: one query token via :func:`torch2step.lower.blocks.gqa.add_gqa_decode`, several
    (prefill, causal or not, any number of tokens fixed at run time) via
    :func:`torch2step.lower.blocks.attention_prefill.add_gqa_prefill`.

    Key ``j`` of request ``b`` is visible iff ``j < kv_lengths[b]`` or ``j >= L - S`` (the
    layer operator's rule); without ``kv_lengths`` every request sees all ``L`` keys, i.e.
    the host passes ``kv_len = L - S`` for each request."""
    from torch2step.lower.blocks.attention_prefill import add_gqa_prefill
    from torch2step.lower.blocks.gqa import add_gqa_decode
    from torch2step.lower.blocks.gqa_regions import assign_coarse, assign_interleave

    op = n.op
    assert isinstance(op, L.Attention)
    q, k, v = n.inputs[:3]
    bsz, hq, seq, dq = ctx.shape(q)
    _, hkv, length, dk = ctx.shape(k)
    if len(n.inputs) > 3:
        kv_len = ctx.tensor_as(n.inputs[3], (bsz, 1))
    else:
        tail = sp.sympify(seq)

        def uniform(b: dict[str, int]) -> np.ndarray:
            nb, ln = concrete([bsz, length - tail], b)
            return np.full((nb, 1), ln, dtype=np.int64)

        kv_len = ctx.host_index(ctx.prefix() + "_kv_len", (bsz, 1), uniform)
    opts, regions = ctx.options, {}
    if opts.attn_regions is not None:
        if seq != 1:
            raise ctx.fail(
                f"attn_regions applies to decode attention (one query token); this attention "
                f"has {seq} query tokens: drop attn_regions for prefill"
            )
        R, how, chunk = int(opts.attn_regions), opts.attn_assign, opts.attn_coarse_chunk

        def assign(b: dict[str, int]) -> np.ndarray:
            (nb,) = concrete([bsz], b)
            if how == "coarse":
                return assign_coarse(nb, R, chunk)
            return assign_interleave(nb, R)  # "dynamic": the start simulate_dispatched refines

        regions = {
            "regions": R,
            "region": ctx.host_index(ctx.prefix() + "_region", (bsz, 1), assign),
        }
    kw = dict(
        k_cache=ctx.tensor_as(k, (bsz * hkv * length, dk)),
        v_cache=ctx.tensor_as(v, (bsz * hkv * length, dk)),
        kv_len=kv_len,
        num_q_heads=op.num_q_heads,
        num_kv_heads=op.num_kv_heads,
        scale=op.scale,
        tile_kv=ctx.options.tile_kv,
        prefix=ctx.prefix(),
    )
    if seq == 1:  # decode: the one new row is the last of the cache
        if not regions:
            lanes = opts.attn_lanes if opts.attn_lanes is not None else ATTN_LANES
            items = sp.sympify(bsz * hkv)
            regions = {"lanes": int(min(lanes, items)) if items.is_Integer else int(lanes)}
        add_gqa_decode(
            ctx.graph,
            q=ctx.tensor_as(q, (bsz * hq, dq)),
            out=ctx.declare(n.outputs[0]),
            tail_rows=1,
            **kw,
            **regions,
        )
        return
    if not sp.sympify(dq).is_Integer:
        raise ctx.fail(f"attention head dim {dq} must be static to lower")
    add_gqa_prefill(
        ctx.graph,
        q=ctx.tensor_as(q, (bsz * hq * seq, dq)),
        out=ctx.declare(n.outputs[0]),
        head_dim=int(dq),
        causal=op.causal,
        **kw,
    )
