"""Raising rotary position embeddings (RoPE, rotate-half form) into
:class:`~torch2step.layers.ops.Rotary`.

The ATen spelling of HF's ``apply_rotary_pos_emb`` with its rotary-embedding module::

    freqs = float(positions[..., None]) * inv_freq          # [B, S, D/2]
    emb   = cat([freqs, freqs], -1); cos = cos(emb) * 1.0; sin = sin(emb) * 1.0
    out   = x * cos[:, None] + cat([-x[..., D/2:], x[..., :D/2]], -1) * sin[:, None]

The pattern reads the integer positions and the frequency table; ``theta`` is fitted from
``inv_freq`` and the whole table checked against ``theta ** (-2i / D)`` (scaled RoPE variants
such as Llama-3's or YaRN's do not fit and are reported).  ``rotary_embedding_op`` raises the
fused ``RotaryEmbedding`` op of ONNX opset 23 with the same reading of its cos/sin tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import sympy
import torch
from torch import fx

from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Cap, Match, NoMatch, P, Pattern, match
from torch2step.frontend.fx_view import ProgramView, op_name, raw_shape, strip, strip_casts
from torch2step.frontend.raise_positions import symbolic_positions
from torch2step.layers import ops as L
from torch2step.step.fn_library_layers import rope_inv_freq

__all__ = ["ROTARY", "ROTARY_OP", "rope_theta", "theta_of"]

_HALF = P("cat", [P("neg", P("slice", Cap("x"), Cap("d1"), Cap("h"), Cap("e1"))),
                  P("slice", Cap("x"), Cap("d2"), 0, Cap("h"))], Cap("dc"))  # fmt: skip
_ROPE = P("add", P("mul", Cap("x"), Cap("cos")), P("mul", _HALF, Cap("sin")))


def fit_rope(
    inv_freq: Any, dim: int | None = None, hint: float | None = None
) -> tuple[float, str] | None:
    """``(theta, table_dtype)`` with ``inv_freq == theta ** -(arange(0, d, 2) / d)``,
    ``d = 2 * len(inv_freq)`` (``dim`` when given), the table held in ``table_dtype`` (a bf16
    model's ``inv_freq`` buffer is that table rounded to bf16), or None (a scaled RoPE variant
    such as Llama-3's or YaRN's); both frontends fit it here.  ``hint`` (the module's configured
    ``rope_theta``) is tried first."""
    if isinstance(inv_freq, torch.Tensor):
        inv_freq = inv_freq.detach().float().cpu().numpy()
    f = np.asarray(inv_freq, dtype=np.float64).reshape(-1)
    if f.size < 2 or (dim is not None and 2 * f.size != dim) or not bool((f > 0).all()):
        return None
    # least squares in log space: log f_i = -(2i / d) log theta; fp32 tables round theta
    expo = np.arange(0, 2 * f.size, 2) / (2 * f.size)
    fitted = math.exp(-(np.log(f) * expo).sum() / (expo * expo).sum())
    cands = [] if hint is None else [float(hint)]
    cands += [float(f"{fitted:.{k}g}") for k in (6, 3, 2, 1)]
    for theta in cands:
        if np.allclose(f, theta**-expo, rtol=1e-4, atol=0):
            return theta, "float32"
    held = torch.as_tensor(f, dtype=torch.float32)
    for theta in cands:
        for dt in ("bfloat16", "float16"):
            if torch.equal(rope_inv_freq(theta, 2 * f.size, dt), held):
                return theta, dt
    return None


def rope_theta(inv_freq: Any, dim: int | None = None) -> float | None:
    """``theta`` of :func:`fit_rope`, or None."""
    fit = fit_rope(inv_freq, dim)
    return None if fit is None else fit[0]


def _table(view: ProgramView, node: fx.Node, fn: str) -> tuple[fx.Node, fx.Node, int]:
    """``(emb, table, unsqueezed_axis)`` for ``unsqueeze(fn(emb) [* 1.0], axis)``."""
    u = strip_casts(node)
    if op_name(u) != "unsqueeze":
        raise NoMatch(f"RoPE {fn} table is not unsqueezed over heads")
    axis = u.args[1] % view.rank(u)
    t = strip_casts(u.args[0])
    if op_name(t) == "mul":
        a, b = t.args[:2]
        if isinstance(a, (int, float)):
            a, b = b, a
        if not isinstance(b, (int, float)) or float(b) != 1.0:
            raise NoMatch("RoPE with attention scaling != 1 (a scaled RoPE variant)")
        t = strip_casts(a)
    if op_name(t) != fn:
        raise NoMatch(f"RoPE {fn} table is not {fn}(angles)")
    return strip_casts(t.args[0]), t, axis


def _positions(view: ProgramView, emb: fx.Node) -> tuple[fx.Node, Any]:
    """``(positions, inv_freq)`` from ``emb = cat([f, f], -1)`` with ``f = pos[..., None] * inv``
    or ``f = (inv[:, None] @ pos[None, :]).T`` (as HF writes it and ONNX exporters keep it)."""
    caps = match(P("cat", [Cap("f"), Cap("f")], Cap("dim")), emb)
    if caps is None:
        raise NoMatch("RoPE angles are not cat([freqs, freqs], -1)")
    return _freqs(view, caps["f"])


def _freqs(view: ProgramView, freqs: Any) -> tuple[fx.Node, Any]:
    """``(positions, inv_freq)`` from the half-size angle table ``freqs``."""
    f = strip_casts(freqs)
    mm = strip_casts(f.args[0]) if op_name(f) == "permute" else None
    if op_name(mm) == "matmul":
        inv, p = view.const(mm.args[0]), strip_casts(mm.args[1])
        if inv is not None and op_name(p) == "unsqueeze" and p.args[1] == 1:
            return strip_casts(p.args[0]), inv.reshape(-1)
        raise NoMatch("RoPE freqs are not inv_freq @ positions")
    if op_name(f) != "mul":
        raise NoMatch("RoPE freqs are not positions * inv_freq")
    for a, b in (f.args[:2], f.args[1::-1]):
        inv = view.const(b)
        if inv is None or inv.dim() == 0 or inv.numel() != inv.shape[-1]:
            continue
        p = strip_casts(a)
        if op_name(p) == "unsqueeze" and p.args[1] in (-1, view.rank(p) - 1):
            return strip_casts(p.args[0]), inv.reshape(-1)
        if view.rank(p) == 3 and raw_shape(p)[-1] == 1:
            return p, inv.reshape(-1)  # positions [B, S, 1] (ONNX: unsqueezed, or folded)
    raise NoMatch("RoPE freqs are not positions[..., None] * inv_freq (a constant table)")


def _match_rotary(view: ProgramView, node: fx.Node) -> Match | None:
    caps = match(_ROPE, node)
    if caps is None:
        return None
    x = caps["x"]
    rank = view.rank(x)
    d = raw_shape(x)[-1]
    if rank != 4 or not isinstance(d, int) or caps["h"] * 2 != d:
        raise NoMatch("RoPE over part of the head (partial rotary) or on a non-[B, H, S, D] x")
    if {caps["d1"] % rank, caps["d2"] % rank, caps["dc"] % rank} != {rank - 1}:
        return None
    emb_c, _, axis_c = _table(view, caps["cos"], "cos")
    emb_s, _, axis_s = _table(view, caps["sin"], "sin")
    if emb_c is not emb_s or axis_c != axis_s or axis_c not in (1, 2):
        raise NoMatch("RoPE cos and sin are not of the same angles")
    pos, inv = _positions(view, emb_c)
    fit = (view.rope_theta, "float32") if inv.is_meta else fit_rope(inv, d, view.rope_theta)
    if inv.is_meta and view.rope_theta is None:
        raise NoMatch("RoPE frequencies are on the meta device and the module has no rope_theta")
    table: tuple[float, ...] = ()
    if fit is None:  # a scaled RoPE (Llama 3.1's "llama3", ...): its own table, as it is
        if inv.numel() * 2 != d or not bool((inv > 0).all()):
            raise NoMatch("RoPE inv_freq is not a positive table of D / 2 frequencies")
        table = tuple(float(v) for v in inv.detach().float().reshape(-1).tolist())
        fit = (float(view.rope_theta or 0.0), "float32")
    theta, held_in = fit
    if view.dtype(pos).is_floating_point:
        raise NoMatch("RoPE positions are not integers")
    src = pos
    if op_name(src) == "expand":  # positions broadcast over the batch: Rotary broadcasts too
        src = strip(src.args[0])
    if view.rank(src) not in (1, 2) and not (view.rank(src) == 3 and raw_shape(src)[-1] == 1):
        raise NoMatch("RoPE positions are not [B, S] (or [S])")
    heads_axis = axis_c
    op = L.Rotary(theta, d, held_in, table)
    # any arithmetic on the cache length (an ONNX graph has folded it into a known value)
    from_sizes = symbolic_positions(view, src) if isinstance(src, fx.Node) else None

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(node)
        if from_sizes is not None:
            start, length = from_sizes
            end = sympy.expand(sympy.sympify(start) + length)
            rng = L.Arange(start, int(end) if end.is_Integer else end)
            if rng not in em.memo:
                em.memo[rng] = em.emit1(rng, [])
            p = em.memo[rng]
        else:
            p = em.get(src)
        shape = em.graph.types[p].shape
        if len(shape) == 3:  # [B, S, 1]
            p, shape = em.reshape(p, shape[:2]), shape[:2]
        if len(shape) == 1:
            p = em.reshape(p, (1, shape[0]))
        h = em.get(x)
        if heads_axis == 2:  # x is [B, S, H, D]
            h = em.emit1(L.Permute((0, 2, 1, 3)), [h])
        out = em.emit1(op, [h, p])
        if heads_axis == 2:
            out = em.emit1(L.Permute((0, 2, 1, 3)), [out])
        return [out]

    reads = (x,) if from_sizes is not None else (x, src)
    return Match("rotary", (node,), reads, emit, {"theta": theta, "rotary_dim": d})


ROTARY = Pattern(
    "rotary",
    frozenset({"add"}),
    _match_rotary,
    "x * cos + rotate_half(x) * sin with cos/sin of positions * inv_freq -> Rotary",
)


def theta_of(inv_freq: Any) -> tuple[float, str]:
    """:func:`fit_rope`, or NoMatch naming the scaled RoPE variant it is not."""
    fit = fit_rope(inv_freq)
    if fit is None:
        raise NoMatch(
            "inverse frequencies are not theta^(-2i/d) (a scaled RoPE variant such as llama3 "
            "or yarn); only the default RoPE has a layer op"
        )
    return fit


def _angles(view: ProgramView, node: Any, fn: str) -> Any:
    """``a`` for a table ``fn(a)`` behind views, casts and a ``* 1.0``."""
    n = strip_casts(node)
    while op_name(n) in ("unsqueeze", "view", "expand", "mul"):
        if op_name(n) == "mul" and 1.0 not in n.args[:2]:
            break
        n = strip_casts(
            next(a for a in n.args[:2] if a != 1.0) if op_name(n) == "mul" else n.args[0]
        )
    if op_name(n) != fn:
        raise NoMatch(f"the rotary table is not {fn}(angles) (or is scaled)")
    return n.args[0]


def _match_rotary_op(view: ProgramView, node: Any) -> Match | None:
    """The fused ``RotaryEmbedding(x, cos, sin[, position_ids])`` op (ONNX opset 23), its
    cos/sin computed from positions or constant caches indexed by ``position_ids``."""
    if node.kwargs.get("interleaved", 0):
        raise NoMatch("interleaved rotary embedding; the Rotary op is the rotate-half form")
    x, cos, sin = node.args[:3]
    pos = node.args[3] if len(node.args) > 3 else None
    if view.rank(x) != 4:
        raise NoMatch("RotaryEmbedding on 3-D input; export with 4-D [B, heads, S, d] input")
    if pos is not None:
        cc, cs = view.const(cos), view.const(sin)
        if cc is None or cs is None or cc.shape[0] < 2:
            raise NoMatch("RotaryEmbedding with position_ids needs constant cos/sin caches")
        inv = torch.atan2(cs[1], cc[1])
    else:
        angles = _angles(view, cos, "cos")
        if _angles(view, sin, "sin") is not angles:
            raise NoMatch("cos and sin are taken of different angles")
        pos, inv = _freqs(view, angles)
    (theta, held_in), dim = (
        theta_of(inv),
        int(node.kwargs.get("rotary_embedding_dim", 0)) or 2 * inv.numel(),
    )
    if dim != 2 * inv.numel():
        raise NoMatch(f"rotary_embedding_dim {dim} does not match {inv.numel()} frequencies")
    b, s = view.shape(x)[0], view.shape(x)[2]

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(node)
        p = em.get(pos)
        shape = em.graph.types[p].shape
        lead = shape[0] if len(shape) >= 2 and sympy.expand(shape[0] - b) == 0 else 1
        return [em.emit1(L.Rotary(theta, dim, held_in), [em.get(x), em.reshape(p, (lead, s))])]

    return Match("rotary_embedding_op", (node,), (x, pos), emit, {"theta": theta})


ROTARY_OP = Pattern(
    "rotary_embedding_op",
    frozenset({"RotaryEmbedding"}),
    _match_rotary_op,
    "the fused RotaryEmbedding op (ONNX opset 23) -> Rotary",
)
