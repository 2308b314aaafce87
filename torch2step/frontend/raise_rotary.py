"""Raising rotary position embeddings (RoPE, rotate-half form) into
:class:`~torch2step.layers.ops.Rotary`.

The ATen spelling of HF's ``apply_rotary_pos_emb`` with its rotary-embedding module::

    freqs = float(positions[..., None]) * inv_freq          # [B, S, D/2]
    emb   = cat([freqs, freqs], -1); cos = cos(emb) * 1.0; sin = sin(emb) * 1.0
    out   = x * cos[:, None] + cat([-x[..., D/2:], x[..., :D/2]], -1) * sin[:, None]

The pattern reads the integer positions and the frequency table; ``theta`` is fitted from
``inv_freq`` and the whole table checked against ``theta ** (-2i / D)`` (scaled RoPE variants
such as Llama-3's or YaRN's do not fit and are reported).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import sympy
from torch import fx

from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Cap, Match, NoMatch, P, Pattern, match
from torch2step.frontend.fx_view import ProgramView, op_name, raw_shape, strip, strip_casts
from torch2step.frontend.raise_positions import symbolic_positions
from torch2step.layers import ops as L

__all__ = ["ROTARY", "rope_theta"]

_HALF = P("cat", [P("neg", P("slice", Cap("x"), Cap("d1"), Cap("h"), Cap("e1"))),
                  P("slice", Cap("x"), Cap("d2"), 0, Cap("h"))], Cap("dc"))  # fmt: skip
_ROPE = P("add", P("mul", Cap("x"), Cap("cos")), P("mul", _HALF, Cap("sin")))


def rope_theta(inv_freq: Any, dim: int | None = None) -> float | None:
    """``theta`` with ``inv_freq == theta ** -(arange(0, d, 2) / d)``, ``d = 2 * len(inv_freq)``
    (``dim`` when given), or None (a scaled RoPE variant such as Llama-3's or YaRN's); both
    frontends fit it here."""
    f = np.asarray(inv_freq, dtype=np.float64).reshape(-1)
    if f.size < 2 or (dim is not None and 2 * f.size != dim) or not bool((f > 0).all()):
        return None
    # least squares in log space: log f_i = -(2i / d) log theta; fp32 tables round theta
    expo = np.arange(0, 2 * f.size, 2) / (2 * f.size)
    theta = float(f"{math.exp(-(np.log(f) * expo).sum() / (expo * expo).sum()):.6g}")
    return theta if np.allclose(f, theta**-expo, rtol=1e-4, atol=0) else None


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
    """``(positions, inv_freq)`` from ``emb = cat([f, f], -1)``, ``f = pos[..., None] * inv``."""
    caps = match(P("cat", [Cap("f"), Cap("f")], Cap("dim")), emb)
    if caps is None:
        raise NoMatch("RoPE angles are not cat([freqs, freqs], -1)")
    f = strip_casts(caps["f"])
    if op_name(f) != "mul":
        raise NoMatch("RoPE freqs are not positions * inv_freq")
    for a, b in (f.args[:2], f.args[1::-1]):
        inv = view.const(b)
        if inv is None or inv.dim() != 1:
            continue
        p = strip_casts(a)
        if op_name(p) == "unsqueeze" and p.args[1] in (-1, view.rank(p) - 1):
            return strip(p.args[0]), inv
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
    theta = view.rope_theta if inv.is_meta else rope_theta(inv, d)
    if theta is None and inv.is_meta:
        raise NoMatch("RoPE frequencies are on the meta device and the module has no rope_theta")
    if theta is None:
        raise NoMatch("RoPE inv_freq is not theta ** (-2i / D) (scaled RoPE variant)")
    if view.dtype(pos).is_floating_point:
        raise NoMatch("RoPE positions are not integers")
    src = pos
    if op_name(src) == "expand":  # positions broadcast over the batch: Rotary broadcasts too
        src = strip(src.args[0])
    if view.rank(src) not in (1, 2):
        raise NoMatch("RoPE positions are not [B, S] (or [S])")
    heads_axis = axis_c
    op = L.Rotary(theta, d)
    from_sizes = symbolic_positions(view, src)  # any arithmetic on the cache length

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
