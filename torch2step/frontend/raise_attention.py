"""Raising attention into one :class:`~torch2step.layers.ops.Attention` op.

Two spellings (as HF writes attention with a KV cache):

- ``attention_sdpa``: one ``aten.scaled_dot_product_attention`` (kept whole by capture), with
  ``enable_gqa=True`` or with K/V repeated per query group by ``repeat_kv``;
- ``attention_eager``: ``repeat_kv`` (``unsqueeze/expand/reshape``) -> ``matmul(q, k^T)`` ->
  ``* scale`` -> ``+ mask`` -> ``softmax`` (fp32) -> ``matmul(p, v)``, where each 4-D matmul is
  ``expand/view -> bmm -> view`` after decomposition.

``repeat_kv`` is undone (the op keeps ``Hkv`` KV heads: query head ``h`` reads KV head
``h // (Hq // Hkv)``), and the mask is recognised by running it (:func:`classify_mask`): a causal
mask, a KV-length mask from an integer ``kv_lengths[B]`` input, both, or none.  The per-request
KV lengths stay run-time data of the op: STeP's dynamic parallelization of GQA decode over ragged
caches (STeP §5.4) needs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import sympy
from torch import fx

from torch2step.frontend.fx_emit import FxEmitter
from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.fx_probe import classify_mask
from torch2step.frontend.fx_view import ProgramView, op_name, raw_shape, strip, strip_casts
from torch2step.layers import ops as L

__all__ = ["ATTENTION_SDPA", "ATTENTION_EAGER", "repeat_kv_source", "matmul4"]

_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})


def repeat_kv_source(view: ProgramView, node: fx.Node) -> tuple[fx.Node, int]:
    """``(kv, n_rep)`` when ``node`` is HF's ``repeat_kv(kv, n_rep)``:
    ``reshape(expand(kv[:, :, None], [B, Hkv, n_rep, L, D]), [B, Hkv * n_rep, L, D])``;
    ``(node, 1)`` otherwise."""
    n = strip(node)
    if op_name(n) not in _VIEWS:
        return n, 1
    e = strip(n.args[0])
    if op_name(e) != "expand":
        return n, 1
    u = strip(e.args[0])
    if op_name(u) != "unsqueeze" or u.args[1] != 2 or view.rank(u) != 5:
        return n, 1
    kv = strip(u.args[0])
    rep = raw_shape(e)[2]
    if not isinstance(rep, int) or view.rank(n) != 4:
        return n, 1
    return kv, rep


def matmul4(view: ProgramView, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` when ``node`` is a batched ``a @ b`` of rank-4 tensors decomposed into
    ``view(bmm(view(expand(a)), view(expand(b))))``."""
    n = strip(node)
    if op_name(n) in ("matmul",) and view.rank(n) == 4:
        return n.args[0], n.args[1]
    if op_name(n) not in _VIEWS or view.rank(n) != 4:
        return None
    bmm = strip(n.args[0])
    if op_name(bmm) != "bmm":
        return None
    out = []
    for arg in bmm.args[:2]:
        a = strip(arg)
        if op_name(a) not in _VIEWS:
            return None
        a = strip(a.args[0])
        if op_name(a) == "expand":
            a = strip(a.args[0])
        if view.rank(a) != 4:
            return None
        out.append(a)
    return out[0], out[1]


def _transposed_k(node: fx.Node) -> fx.Node | None:
    n = strip(node)
    if op_name(n) == "permute" and list(n.args[1]) == [0, 1, 3, 2]:
        return n.args[0]
    if op_name(n) == "transpose" and sorted(d % 4 for d in n.args[1:3]) == [2, 3]:
        return n.args[0]
    return None


def _scaled(node: fx.Node) -> tuple[fx.Node, float]:
    """``(x, c)`` for ``x * c`` / ``x / c`` with a Python number ``c``; ``(node, 1.0)`` else."""
    n = strip(node)
    if op_name(n) in ("mul", "div"):
        a, b = n.args[:2]
        if isinstance(a, (int, float)) and op_name(n) == "mul":
            a, b = b, a
        if isinstance(b, (int, float)) and isinstance(a, fx.Node):
            return a, float(b) if op_name(n) == "mul" else 1.0 / float(b)
    return n, 1.0


def _heads(view: ProgramView, node: fx.Node) -> int:
    h = raw_shape(node)[1]
    if not isinstance(h, int):
        raise NoMatch(f"attention head count of {node.name} is not static")
    return h


def _attention(
    view: ProgramView,
    root: fx.Node,
    name: str,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    scale: float,
    causal: bool,
    mask: fx.Node | None,
) -> Match:
    kvl = None
    if mask is not None:
        mask_causal, kvl = classify_mask(view, mask, q, k)
        causal = causal or mask_causal
    hq, hkv = _heads(view, q), _heads(view, k)
    if hq % hkv:
        raise NoMatch(f"{hq} query heads is not a multiple of {hkv} KV heads")
    op = L.Attention(hq, hkv, float(scale), causal)
    inputs = (q, k, v) if kvl is None else (q, k, v, kvl)

    def emit(em: FxEmitter) -> Sequence[str]:
        em.at(root)
        args = [em.get(i) for i in inputs]
        if kvl is not None:
            args[3] = em.cast(args[3], "int64")
        return [em.emit1(op, args)]

    info = {"num_q_heads": hq, "num_kv_heads": hkv, "scale": scale, "causal": causal}
    return Match(name, (root,), inputs, emit, {**info, "kv_lengths": kvl})


def _match_sdpa(view: ProgramView, node: fx.Node) -> Match | None:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    if args.get("dropout_p", 0.0) not in (0, 0.0):
        raise NoMatch("scaled_dot_product_attention with dropout")
    q = args["query"]
    k, rk = repeat_kv_source(view, args["key"])
    v, rv = repeat_kv_source(view, args["value"])
    if rk != rv:
        return None
    d = raw_shape(q)[-1]
    scale = args.get("scale")
    if scale is None:
        if not isinstance(d, int):
            raise NoMatch("sdpa default scale needs a static head_dim")
        scale = 1.0 / math.sqrt(d)
    causal = bool(args.get("is_causal", False))
    if causal and sympy.expand(raw_shape(q)[2] - raw_shape(k)[2]) != 0:
        raise NoMatch(
            "sdpa is_causal=True aligns queries to the first keys (top-left); with a KV cache "
            "(S != L) pass an explicit mask instead"
        )
    return _attention(view, node, "attention_sdpa", q, k, v, scale, causal, args.get("attn_mask"))


ATTENTION_SDPA = Pattern(
    "attention_sdpa",
    frozenset({"scaled_dot_product_attention"}),
    _match_sdpa,
    "scaled_dot_product_attention (enable_gqa or repeat_kv K/V; causal / kv-length mask)",
)


def _match_eager(view: ProgramView, node: fx.Node) -> Match | None:
    mm = matmul4(view, node)
    if mm is None:
        return None
    p, vr = mm
    sm = strip_casts(p)
    if op_name(sm) not in ("_softmax", "softmax") or sm.args[1] not in (-1, 3):
        return None
    scores = strip_casts(sm.args[0])
    mask = None
    qk = None
    if op_name(scores) == "add":
        for a, b in (scores.args[:2], scores.args[1::-1]):
            inner, scale = _scaled(a)
            if isinstance(b, fx.Node) and matmul4(view, inner) is not None:
                qk, mask = (inner, scale), b
                break
    if qk is None:
        qk = _scaled(scores)
    inner, scale = qk
    pair = matmul4(view, inner)
    if pair is None:
        return None
    q, kt = pair
    q, qscale = _scaled(q)
    kr = _transposed_k(kt)
    if kr is None:
        return None
    k, rk = repeat_kv_source(view, kr)
    v, rv = repeat_kv_source(view, vr)
    if rk != rv:
        return None
    return _attention(view, node, "attention_eager", q, k, v, scale * qscale, False, mask)


ATTENTION_EAGER = Pattern(
    "attention_eager",
    frozenset(_VIEWS | {"matmul"}),
    _match_eager,
    "repeat_kv -> matmul(q, k^T) * scale (+ mask) -> softmax -> matmul(p, v)",
)
