"""Raising patterns for rotary position embeddings (RoPE, rotate-half form as HF Llama/Qwen3).

- ``rotary_decomposed``: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
  Concat(Neg(x[..., d/2:]), x[..., :d/2])`` and ``cos``/``sin`` = ``Cos``/``Sin`` of
  ``Concat(f, f)``, ``f = positions * inv_freq`` (opset 20);
- ``rotary_embedding_op``: the opset-23 ``RotaryEmbedding`` op, with the cos/sin inputs computed
  from positions or given as constant caches indexed by ``position_ids``.

Both recover ``theta`` from ``inv_freq = theta ** (-2i / d)`` (a scaled RoPE variant is
reported) and the integer positions ``[B, S]`` the :class:`~torch2step.layers.ops.Rotary` op
reads; positions computed from the KV-cache length become ``Arange`` in the layer graph.
"""

from __future__ import annotations

import numpy as np

from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.onnx_patterns import Match, Pattern, scalar_factor
from torch2step.frontend.raise_rotary import rope_theta
from torch2step.layers import ops as L

__all__ = ["ROTARY_PATTERNS", "theta_of", "trace_positions"]

_TABLE_VIEWS = ("Unsqueeze", "Reshape", "Cast", "Identity", "Expand")


def theta_of(inv_freq: np.ndarray) -> float:
    """``theta`` of the default RoPE (:func:`~torch2step.frontend.raise_rotary.rope_theta`)."""
    theta = rope_theta(inv_freq)
    if theta is None:
        raise Unsupported(
            "inverse frequencies are not theta^(-2i/d) (a scaled RoPE variant such as llama3 "
            "or yarn); only the default RoPE has a layer op"
        )
    return theta


def trace_positions(view: OnnxView, freqs: str, nodes: set[str]) -> tuple[str, np.ndarray]:
    """``freqs = positions * inv_freq`` -> ``(positions value, inv_freq)``; the positions value
    is the integer tensor before its ``Cast`` (shape ``[..., S, 1]`` or ``[B, 1, S]``)."""
    p = view.producer.get(freqs)
    if p is not None and p.op_type == "Transpose":  # HF: (inv_freq[:, None] @ pos[None, :]).T
        mm = view.producer_of(p.inputs[0], "MatMul")
        inv = view.const(mm.inputs[0]) if mm else None
        if mm is None or inv is None:
            raise Unsupported("rotary frequencies are not inv_freq @ positions")
        nodes.update({p.name, mm.name})
        return _uncast(view, mm.inputs[1], nodes), inv.reshape(-1)
    if p is None or p.op_type != "Mul":
        raise Unsupported("rotary frequencies are not positions * inv_freq")
    for i in (0, 1):
        inv = view.const(p.inputs[i])
        if inv is not None and inv.size > 1 and inv.size == inv.shape[-1]:
            nodes.add(p.name)
            return _uncast(view, p.inputs[1 - i], nodes), inv.reshape(-1)
    raise Unsupported("rotary frequencies are not positions * a constant inv_freq")


def _uncast(view: OnnxView, value: str, nodes: set[str]) -> str:
    """The integer positions behind ``Cast(positions, float)``."""
    p = view.producer_of(value, "Cast")
    if p is None or view.dtypes.get(p.inputs[0]) not in ("int64", "int32"):
        raise Unsupported("rotary positions are not an integer tensor cast to float")
    nodes.add(p.name)
    return p.inputs[0]


def _table(view: OnnxView, value: str, trig: str, nodes: set[str]) -> str:
    """``value`` = (views of) ``trig(emb)`` -> ``emb``."""
    while True:
        p = view.producer.get(value)
        if p is None:
            break
        sf = scalar_factor(view, p)
        if sf is not None and sf[1] == 1.0:
            nodes.add(p.name)
            value = sf[0]
        elif p.op_type in _TABLE_VIEWS:
            nodes.add(p.name)
            value = p.inputs[0]
        else:
            break
    p = view.producer_of(value, trig)
    if p is None:
        raise Unsupported(f"the rotary table is not {trig}(angles) (or is scaled)")
    nodes.add(p.name)
    return p.inputs[0]


def _rotate_half(view: OnnxView, value: str, x: str) -> set[str] | None:
    cat = view.producer_of(value, "Concat")
    d = (view.shape(x) or (None,))[-1]
    if cat is None or len(cat.inputs) != 2 or not isinstance(d, int) or d % 2:
        return None
    rank = view.rank(x)
    if int(cat.attr("axis")) not in (-1, (rank or 0) - 1):
        return None
    neg = view.producer_of(cat.inputs[0], "Neg")
    hi = view.producer_of(neg.inputs[0], "Slice") if neg else None
    lo = view.producer_of(cat.inputs[1], "Slice")
    if hi is None or lo is None or hi.inputs[0] != x or lo.inputs[0] != x:
        return None
    if _bounds(view, hi, d) != (d // 2, d) or _bounds(view, lo, d) != (0, d // 2):
        return None
    assert neg is not None
    return {cat.name, neg.name, hi.name, lo.name}


def _bounds(view: OnnxView, s: OnnxNode, d: int) -> tuple[int, int] | None:
    vals = [view.ints(v) if v else None for v in s.inputs[1:5]]
    starts, ends = vals[0], vals[1]
    axes = vals[2] if len(vals) > 2 else None
    steps = vals[3] if len(vals) > 3 else None
    if starts is None or ends is None or len(starts) != 1 or (steps and steps != [1]):
        return None
    rank = view.rank(s.inputs[0]) or 0
    if axes is not None and int(axes[0]) % rank != rank - 1:
        return None
    lo, hi = int(starts[0]), int(ends[0])
    lo = lo + d if lo < 0 else lo
    hi = min(hi + d if hi < 0 else hi, d)
    return lo, hi


def _emit_rotary(
    em: Emitter, node: OnnxNode, x: str, pos: str, theta: float, dim: int, out: str
) -> None:
    xv = em.get(x)
    pv = em.get(pos)
    shape = em.type(pv).shape
    b = em.type(xv).shape[0]
    s = em.type(xv).shape[2]
    lead = shape[0] if len(shape) >= 2 and shape[0] == b else 1
    pv = em.reshape(pv, (lead, s))
    em.emit1(L.Rotary(theta, dim), [xv, pv], out, source=node.source)


def match_rotary_decomposed(view: OnnxView, node: OnnxNode) -> Match | None:
    """``Add(Mul(x, cos), Mul(rotate_half(x), sin))`` (operands in any order)."""
    for a in (0, 1):
        m_cos = view.producer_of(node.inputs[a], "Mul")
        m_sin = view.producer_of(node.inputs[1 - a], "Mul")
        if m_cos is None or m_sin is None:
            continue
        for i in (0, 1):
            x, cos_v = m_cos.inputs[i], m_cos.inputs[1 - i]
            for j in (0, 1):
                rh = _rotate_half(view, m_sin.inputs[j], x)
                if rh is None:
                    continue
                return _decomposed(
                    view,
                    node,
                    x,
                    cos_v,
                    m_sin.inputs[1 - j],
                    {node.name, m_cos.name, m_sin.name} | rh,
                )
    return None


def _decomposed(
    view: OnnxView, node: OnnxNode, x: str, cos_v: str, sin_v: str, nodes: set[str]
) -> Match:
    shape = view.shape(x)
    tshape = view.shape(cos_v)
    if shape is None or len(shape) != 4 or tshape is None or len(tshape) != 4 or tshape[1] != 1:
        raise Unsupported(
            "rotary embedding on x of shape other than [B, heads, S, d] with cos/sin "
            "unsqueezed at dim 1; only HF's layout has a Rotary op"
        )
    table: set[str] = set()
    emb_c, emb_s = _table(view, cos_v, "Cos", table), _table(view, sin_v, "Sin", table)
    if emb_c != emb_s:
        raise Unsupported("cos and sin are taken of different angles")
    cat = view.producer_of(emb_c, "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.inputs[0] != cat.inputs[1]:
        raise Unsupported("the rotary angles are not Concat(freqs, freqs) (rotate-half layout)")
    pos, inv = trace_positions(view, cat.inputs[0], table)
    theta, dim = theta_of(inv), 2 * inv.size
    if dim != shape[-1]:
        raise Unsupported(f"partial rotary ({dim} of {shape[-1]} features) is not supported")
    out = node.outputs[0]
    return Match(
        "rotary_decomposed",
        node,
        nodes,
        [x] + ([] if pos in view.known else [pos]),
        [out],
        lambda em: _emit_rotary(em, node, x, pos, theta, dim, out),
        {"theta": theta},
    )


def match_rotary_op(view: OnnxView, node: OnnxNode) -> Match | None:
    """Opset-23 ``RotaryEmbedding(X, cos, sin[, position_ids])``."""
    if node.attr("interleaved", 0):
        raise Unsupported("interleaved rotary embedding; the Rotary op is the rotate-half form")
    x, cos_v, sin_v = node.inputs[:3]
    pos_ids = node.inputs[3] if len(node.inputs) > 3 else ""
    shape = view.shape(x)
    if shape is None or len(shape) != 4:
        raise Unsupported("RotaryEmbedding on 3-D input; export with 4-D [B, heads, S, d] input")
    table: set[str] = set()
    if pos_ids:
        cache_c, cache_s = view.const(cos_v), view.const(sin_v)
        if cache_c is None or cache_s is None or cache_c.shape[0] < 2:
            raise Unsupported("RotaryEmbedding with position_ids needs constant cos/sin caches")
        inv = np.arctan2(cache_s[1], cache_c[1])
        pos = pos_ids
    else:
        fc, fs = _table(view, cos_v, "Cos", table), _table(view, sin_v, "Sin", table)
        if fc != fs:
            raise Unsupported("cos and sin are taken of different angles")
        pos, inv = trace_positions(view, fc, table)
    theta = theta_of(inv)
    dim = int(node.attr("rotary_embedding_dim", 0)) or 2 * inv.size
    if dim != 2 * inv.size:
        raise Unsupported(f"rotary_embedding_dim {dim} does not match {inv.size} frequencies")
    out = node.outputs[0]
    return Match(
        "rotary_embedding_op",
        node,
        {node.name},
        [x] + ([] if pos in view.known else [pos]),
        [out],
        lambda em: _emit_rotary(em, node, x, pos, theta, dim, out),
        {"theta": theta},
    )


ROTARY_PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        "rotary_embedding_op", frozenset({"RotaryEmbedding"}), match_rotary_op, "opset-23 RoPE"
    ),
    Pattern(
        "rotary_decomposed",
        frozenset({"Add"}),
        match_rotary_decomposed,
        "x*cos + rotate_half(x)*sin",
    ),
)
