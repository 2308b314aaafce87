"""Raising (grouped-query) attention into one :class:`~torch2step.layers.ops.Attention` op, the
GQA decode workload of STeP §5.1 — one recogniser for both frontends, on the common view.

Three spellings:

- ``attention_sdpa``: one ``aten.scaled_dot_product_attention`` (kept whole by capture), with
  ``enable_gqa=True`` or with K/V repeated per query group by ``repeat_kv``;
- ``attention_op``: the opset-23 ONNX ``Attention`` op (4-D q/k/v, optional past key/value);
- ``attention_matmul_softmax``: ``matmul(softmax(matmul(q, k') * scale [+ mask]), v')`` as HF
  eager attention is written (each 4-D matmul is ``expand/view -> bmm -> view`` after ATen
  decomposition) and as the dynamo ONNX exporter decomposes sdpa (opset 20: sdpa scales q and k
  by ``sqrt(scale)`` each, and guards fully masked rows with ``Where(IsNaN(p), 0, p)``).

``k'`` and ``v'`` are any chain of view ops and scalar scalings of the 4-D ``k``/``v``
(``repeat_kv``'s unsqueeze/expand/reshape, transposes, 3-D reshapes); what the chain means is
decided by running it on index tensors (:func:`_cut`): it must be ``repeat_kv(k, Hq/Hkv)``
transposed, resp. ``repeat_kv(v, Hq/Hkv)``.  ``repeat_kv`` is undone (the op keeps ``Hkv`` KV
heads: query head ``h`` reads KV head ``h // (Hq // Hkv)``), and the mask is recognised by
running it (:func:`~torch2step.frontend.fx_probe.classify_mask`): causal, a KV-length mask from
an integer ``kv_lengths[B]`` input, both, or none.  The per-request KV lengths stay run-time
data of the op: STeP's dynamic parallelization of GQA decode over ragged caches (STeP §5.4)
needs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.fx_probe import classify_mask
from torch2step.frontend.fx_view import dtype_of, is_node, op_name, raw_shape, strip, strip_casts
from torch2step.frontend.gnode import GNode, same_dim
from torch2step.layers import ops as L

__all__ = ["ATTENTION_SDPA", "ATTENTION_OP", "ATTENTION_MATMUL", "matmul4"]

_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})
#: Ops that only move or re-label the elements of their first argument (ATen and ONNX names).
_MOVES = _VIEWS | {"permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "alias",
                   "clone", "contiguous", "slice", "Squeeze", "Unsqueeze", "Flatten"}  # fmt: skip

Expect = Callable[[torch.Tensor], "torch.Tensor | None"]


def _factor(node: Any) -> tuple[Any, float] | None:
    """``(x, c)`` for ``x * c`` / ``c * x`` / ``x / c`` with a number ``c``, else None."""
    if op_name(node) not in ("mul", "div") or len(node.args) < 2:
        return None
    a, b = node.args[:2]
    if op_name(node) == "mul" and isinstance(a, (int, float)) and is_node(b):
        a, b = b, a
    if not is_node(a) or isinstance(b, bool) or not isinstance(b, (int, float)) or b == 0:
        return None
    return a, float(b) if op_name(node) == "mul" else 1.0 / float(b)


def _step(node: Any) -> tuple[Any, float] | None:
    """One link of a view/scale chain: ``(input, factor)`` (factor 1 for a view op)."""
    if not is_node(node) or node.op != "call_function":
        return None
    f = _factor(node)
    if f is not None:
        return f
    name = op_name(node)
    same = name == "_to_copy" and dtype_of(node) == dtype_of(node.args[0])
    return (node.args[0], 1.0) if (name in _MOVES or same) and is_node(node.args[0]) else None


_SAMPLE_SIZES = (3, 5, 7, 11, 13, 17)


def _small(view: Any, shape: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """The example sizes with every symbol of ``shape`` (batch, KV length) set to a small,
    distinct sample: what a view chain means does not depend on those sizes, and an index
    tensor of a full-size KV cache repeated to the query heads would take gigabytes."""
    syms = sorted(
        {x for d in shape if isinstance(d, sympy.Expr) for x in d.free_symbols}, key=str
    )
    return {**view.hints, **dict(zip(syms, _SAMPLE_SIZES))}


def _cut(view: Any, value: Any, expect: Expect) -> tuple[Any, float]:
    """The deepest 4-D base of ``value``'s view/scale chain that the chain maps to
    ``expect(base_ids)`` (run on an index tensor of the base); returns ``(base, scale)``."""
    chain, n = [], value
    while (s := _step(n)) is not None:
        chain.append((n, s[1]))
        n = s[0]
    bases = [n] + [node for node, _ in reversed(chain)]
    for i, base in enumerate(bases):
        if view.rank(base) != 4:
            continue
        scale = math.prod(f for _, f in chain[: len(chain) - i])
        binding = _small(view, raw_shape(base))
        dims = [view.concrete(d, binding) for d in raw_shape(base)]
        # float32 holds the indices of a sample-sized tensor exactly (ONNX checks types)
        dt = torch.float32 if view.dtype(base) == torch.float32 else torch.float64
        ids = torch.arange(math.prod(dims), dtype=dt).reshape(dims)
        want = expect(ids)
        if want is None:
            continue
        if base is value:
            got = ids
        else:
            try:
                (got,) = view.run([value], {base: ids}, binding)
            except NoMatch:
                continue
        got = torch.as_tensor(got).double() / scale
        if got.shape == want.shape and torch.allclose(got, want.double(), rtol=1e-6, atol=1e-3):
            return base, scale
    raise NoMatch(f"{value.name} is not a (repeated, transposed) view of a 4-D tensor")


def _repeated(hq: int, transposed: bool = False) -> Expect:
    """What a view chain must compute from a KV tensor: ``repeat_kv`` to ``hq`` heads
    (transposed for the keys of ``q @ k^T``)."""

    def expect(ids: torch.Tensor) -> torch.Tensor | None:
        if hq % ids.shape[1]:
            return None
        rep = ids.repeat_interleave(hq // ids.shape[1], dim=1)
        return rep.transpose(2, 3) if transposed else rep

    return expect


def _kv_operand(view: Any, value: Any, hq: int) -> tuple[Any, float]:
    """A K/V operand of a fused attention op: ``repeat_kv`` of a tensor, or the tensor itself
    (the op broadcasts KV heads over query groups)."""
    try:
        return _cut(view, value, _repeated(hq))
    except NoMatch:
        return _cut(view, value, lambda ids: ids if hq % ids.shape[1] == 0 else None)


def _heads(node: Any) -> int:
    h = raw_shape(node)[1]
    if not isinstance(h, int):
        raise NoMatch(f"attention head count of {node.name} is not static")
    return h


def _attention(
    view: Any,
    roots: Sequence[Any],
    name: str,
    qkv: tuple[Any, Any, Any],
    scale: float,
    causal: bool,
    mask: Any,
    past: tuple[Any, Any] | None = None,
) -> Match:
    """The match emitting ``Attention(q, k, v[, kv_lengths])`` at ``roots[0]``; with ``past``
    the caches are concatenated first (``roots[1:]`` are the concatenated K and V)."""
    q, k, v = qkv
    kvl = None
    if mask is not None:
        length = raw_shape(k)[2] + (raw_shape(past[0])[2] if past else 0)
        mask_causal, kvl = classify_mask(view, mask, q, length)
        causal = causal or mask_causal
    hq, hkv = _heads(q), _heads(k)
    if hq % hkv or _heads(v) != hkv:
        raise NoMatch(f"{hq} query heads is not a multiple of {hkv} KV heads (V: {_heads(v)})")
    op = L.Attention(hq, hkv, float(scale), causal)
    inputs = (q, k, v, *(past or ()), *((kvl,) if kvl is not None else ()))
    root = roots[0]
    used = [i for i, r in enumerate(roots) if r is not None]

    def emit(em: Any) -> Sequence[str]:
        em.at(root)
        kk, vv = em.get(k), em.get(v)
        if past:
            kk = em.emit1(L.Concat(2), [em.get(past[0]), kk])
            vv = em.emit1(L.Concat(2), [em.get(past[1]), vv])
        args = [em.get(q), kk, vv]
        if kvl is not None:
            args.append(em.cast(em.get(kvl), "int64"))
        name = root.name if isinstance(root, GNode) else None
        values = [em.emit1(op, args, name), kk, vv]
        return [values[i] for i in used]

    info = {"num_q_heads": hq, "num_kv_heads": hkv, "scale": scale, "causal": causal}
    return Match(name, tuple(roots[i] for i in used), inputs, emit, {**info, "kv_lengths": kvl})


def _fused(
    view: Any, q: Any, k: Any, v: Any, scale: float | None, causal: bool, past: bool
) -> tuple[Any, Any, float]:
    """What sdpa and the ONNX Attention op share: K/V operands (``repeat_kv`` undone), the
    default scale ``1/sqrt(d)`` and the top-left alignment of ``is_causal``."""
    if view.rank(q) != 4:
        raise NoMatch("attention on 3-D inputs; export with 4-D [B, heads, S, d] q/k/v")
    if not past:
        hq = _heads(q)
        k, ks = _kv_operand(view, k, hq)
        v, vs = _kv_operand(view, v, hq)
        if ks != 1.0 or vs != 1.0:
            raise NoMatch("scaled k or v in front of the attention op")
    if scale is None:
        d = raw_shape(q)[-1]
        if not isinstance(d, int):
            raise NoMatch("the default attention scale needs a static head_dim")
        scale = 1.0 / math.sqrt(d)
    if causal and (past or not same_dim(raw_shape(q)[2], raw_shape(k)[2])):
        raise NoMatch(
            "is_causal aligns queries to the first keys (top-left); it is supported when the "
            "query and key lengths are equal (no cache): pass an explicit mask instead"
        )
    return k, v, float(scale)


def _match_sdpa(view: Any, node: Any) -> Match | None:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    if args.get("dropout_p", 0.0) not in (0, 0.0):
        raise NoMatch("scaled_dot_product_attention with dropout")
    q, causal = args["query"], bool(args.get("is_causal", False))
    k, v, scale = _fused(view, q, args["key"], args["value"], args.get("scale"), causal, False)
    mask = args.get("attn_mask")
    return _attention(view, [node], "attention_sdpa", (q, k, v), scale, causal, mask)


ATTENTION_SDPA = Pattern(
    "attention_sdpa",
    frozenset({"scaled_dot_product_attention"}),
    _match_sdpa,
    "scaled_dot_product_attention (enable_gqa or repeat_kv K/V; causal / kv-length mask)",
)


def _match_op(view: Any, node: Any) -> Match | None:
    """Opset-23 ``Attention(Q, K, V[, attn_mask, past_key, past_value, nonpad_kv_seqlen])``."""
    q, k, v, mask, past_k, past_v, nonpad = (list(node.args) + [None] * 7)[:7]
    items = {u.args[1]: u for u in node.users if op_name(u) == "getitem"} or {0: node}
    if float(node.kwargs.get("softcap", 0.0)):
        raise NoMatch("Attention with softcap has no layer op")
    if nonpad is not None:
        raise NoMatch("Attention with nonpad_kv_seqlen; pass a KV-length mask instead")
    if 3 in items and items[3].users:
        raise NoMatch("the attention scores output (qk_matmul_output) is used")
    past = (past_k, past_v) if past_k is not None else None
    causal = bool(node.kwargs.get("is_causal", 0))
    k, v, scale = _fused(view, q, k, v, node.kwargs.get("scale"), causal, past is not None)
    roots = [items.get(i) for i in range(3 if past else 1)]
    return _attention(view, roots, "attention_op", (q, k, v), scale, causal, mask, past)


ATTENTION_OP = Pattern(
    "attention_op", frozenset({"Attention"}), _match_op, "the opset-23 ONNX Attention op"
)


def matmul4(view: Any, node: Any) -> tuple[Any, Any] | None:
    """``(a, b)`` when ``node`` is ``a @ b`` of rank-4 tensors: ``matmul``, or
    ``view(bmm(view(expand(a)), view(expand(b))))`` after ATen decomposition."""
    n = strip(node)
    if op_name(n) == "matmul" and view.rank(n) == 4:
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


def _unscaled(node: Any) -> tuple[Any, float]:
    """``node`` without its casts and scalar scalings, and their product."""
    n, scale = strip_casts(node), 1.0
    while (f := _factor(n)) is not None:
        n, scale = strip_casts(f[0]), scale * f[1]
    return n, scale


def _nan_guard(view: Any, node: Any) -> Any:
    """``where(isnan(p), 0, p)`` (the ONNX sdpa guard for fully masked rows) -> ``p``."""
    n = strip_casts(node)
    if op_name(n) != "where" or len(n.args) != 3 or op_name(n.args[0]) not in ("IsNaN", "isnan"):
        return n
    zero = n.args[1] if not is_node(n.args[1]) else view.const(n.args[1])
    if n.args[0].args[0] is n.args[2] and zero is not None and float(zero) == 0.0:
        return strip_casts(n.args[2])
    return n


def _match_matmul(view: Any, node: Any) -> Match | None:
    mm = matmul4(view, node)
    if mm is None:
        return None
    sm = _nan_guard(view, mm[0])
    if op_name(sm) not in ("_softmax", "softmax") or view.rank(sm) != 4 or sm.args[1] % 4 != 3:
        return None
    scores, scale = _unscaled(sm.args[0])
    mask = None
    if op_name(scores) == "add" and all(is_node(a) for a in scores.args[:2]):
        for a, b in (scores.args[:2], scores.args[1::-1]):
            inner, s = _unscaled(a)
            if matmul4(view, inner) is not None:
                scores, scale, mask = inner, scale * s, b
                break
    qk = matmul4(view, scores)
    if qk is None:
        return None
    q, qs = _cut(view, qk[0], lambda ids: ids)
    hq = _heads(q)
    k, ks = _cut(view, qk[1], _repeated(hq, transposed=True))
    v, _ = _cut(view, mm[1], _repeated(hq))
    scale *= qs * ks
    return _attention(view, [node], "attention_matmul_softmax", (q, k, v), scale, False, mask)


ATTENTION_MATMUL = Pattern(
    "attention_matmul_softmax",
    frozenset(_VIEWS | {"matmul"}),
    _match_matmul,
    "[repeat_kv] -> matmul(q, k^T) * scale (+ mask) -> softmax -> matmul(p, v)",
)
