"""Raising patterns for (grouped-query) attention, the GQA decode workload of STeP §5.1
(Qwen3-30B-A3B, KV lengths from traces).

- ``attention_matmul_softmax``: ``MatMul(Softmax(MatMul(q, k') * scale [+ mask]), v')`` as the
  dynamo exporter writes HF eager attention and the decomposition of
  ``scaled_dot_product_attention`` (opset 20).  ``k'`` and ``v'`` are any chain of view ops on the
  4-D ``k``/``v`` (``repeat_kv``'s Unsqueeze/Expand/Reshape, the transposes, sdpa's 3-D
  reshapes) and scalar scalings (sdpa scales q and k by ``sqrt(scale)`` each); what the chain
  means is decided by running it on index tensors (:func:`~torch2step.frontend.onnx_patterns.
  probe_chain`): it must be ``repeat_kv(k, Hq/Hkv)`` transposed, resp. ``repeat_kv(v, Hq/Hkv)``.
- ``attention_op``: the opset-23 ``Attention`` op (4-D q/k/v, optional past key/value).

A mask is recognised by meaning: its subgraph is run on sample sizes and KV lengths and compared
with the causal and KV-length visibility of :class:`~torch2step.layers.ops.Attention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from torch2step.frontend.fx_pattern import Pattern as CommonPattern
from torch2step.frontend.fx_probe import mask_meaning
from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.onnx_nodes import onnx_pattern
from torch2step.frontend.onnx_patterns import (
    VIEW_OPS,
    Match,
    Pattern,
    concrete,
    last_axis,
    probe_chain,
    scalar_factor,
    strip,
)
from torch2step.frontend.onnx_probe import run_subgraph, upstream
from torch2step.layers import ops as L

__all__ = ["ATTENTION_PATTERNS", "match_attention_matmul", "match_attention_op", "mask_kind"]

Step = tuple[OnnxNode, float | None]


def _steps(view: OnnxView, value: str) -> list[Step]:
    """View ops and scalar scalings producing ``value``, in application order."""
    steps: list[Step] = []
    while True:
        p = view.producer.get(value)
        if p is None:
            break
        sf = scalar_factor(view, p)
        if sf is not None:
            steps.append((p, sf[1]))
            value = sf[0]
        elif p.op_type in VIEW_OPS or (
            p.op_type == "Cast" and view.dtypes.get(p.inputs[0]) == view.dtypes.get(p.outputs[0])
        ):
            steps.append((p, None))
            value = p.inputs[0]
        else:
            break
    return steps[::-1]


def _step_input(view: OnnxView, step: Step) -> str:
    node, factor = step
    if factor is None:
        return node.inputs[0]
    return next(i for i in node.inputs if i not in view.known)


def _cut(
    view: OnnxView, value: str, expect: Callable[[np.ndarray], np.ndarray | None]
) -> tuple[str, float]:
    """The deepest 4-D base of ``value``'s view/scale chain whose remaining chain means
    ``expect(base_ids)``; returns ``(base, scale factor)``."""
    steps = _steps(view, value)
    for i in range(len(steps) + 1):
        base = _step_input(view, steps[i]) if i < len(steps) else value
        if view.rank(base) != 4:
            continue
        rest = steps[i:]
        try:
            base_ids, ids = probe_chain(view, base, [n for n, f in rest if f is None])
        except Unsupported:
            continue
        want = expect(base_ids)
        if want is not None and want.shape == ids.shape and np.array_equal(want, ids):
            return base, math.prod(f for _, f in rest if f is not None)
    raise Unsupported(f"{value!r} is not a (repeated, transposed) view of a 4-D tensor")


def _reaches_matmul(view: OnnxView, value: str) -> bool:
    while True:
        p = view.producer.get(value)
        if p is None:
            return False
        if p.op_type == "MatMul":
            return True
        sf = scalar_factor(view, p)
        if sf is not None:
            value = sf[0]
        elif p.op_type in ("Cast", "Identity"):
            value = p.inputs[0]
        else:
            return False


def mask_kind(view: OnnxView, mask: str, b: int, s: int, length: int) -> tuple[bool, str | None]:
    """What the mask ``mask`` means at sample sizes ``(b, s, length)``: ``(causal, kv_lengths
    input or None)`` per :class:`~torch2step.layers.ops.Attention`; raises Unsupported otherwise."""
    nodes = upstream(view, [mask], set())
    produced = {o for n in nodes for o in n.outputs}
    free = sorted(
        {i for n in nodes for i in n.inputs if i and i not in produced and i not in view.known}
    )
    if mask in view.inputs:
        free = [mask]
    kvl = None
    if free:
        cand = free[0]
        if (
            len(free) > 1
            or cand not in view.inputs
            or view.dtypes.get(cand) not in ("int64", "int32")
            or view.rank(cand) != 1
        ):
            what = "is the graph input" if free == [mask] else "is computed from"
            raise Unsupported(
                f"the attention mask {what} {free}; only causal masks and masks computed from "
                "one integer kv_lengths[B] input have an Attention op (pass kv_lengths instead)"
            )
        kvl = cand
    rng = np.random.default_rng(0)
    trials = [rng.integers(0, length - s + 1, size=b) for _ in range(3)] if kvl else [None]
    if mask in view.inputs:
        raise Unsupported("the attention mask is a graph input; pass kv_lengths instead")
    samples = []
    for lens in trials:
        feeds = {} if lens is None else {kvl: lens.astype(np.int64)}
        if mask in view.known:
            m = view.known[mask]
        else:
            (m,) = run_subgraph(view, nodes, feeds, [mask], view.sample_dims())
        kv = None if lens is None else torch.from_numpy(lens)
        samples.append((b, s, length, kv, torch.from_numpy(np.array(m))))
    return mask_meaning(samples), kvl


def _sizes(view: OnnxView, q: str, k: str) -> tuple[int, int, int, int, int]:
    sample = view.sample_dims()
    qs, ks = view.shape(q), view.shape(k)
    assert qs is not None and ks is not None
    return (
        concrete(qs[0], sample),
        concrete(qs[1], sample),
        concrete(qs[2], sample),
        concrete(ks[1], sample),
        concrete(ks[2], sample),
    )


def _heads(view: OnnxView, value: str) -> int:
    shape = view.shape(value)
    if shape is None or not isinstance(shape[1], int):
        raise Unsupported(f"the number of heads of {value!r} is not static")
    return shape[1]


def _nan_guard(view: OnnxView, value: str) -> str:
    """``Where(IsNaN(p), 0, p)`` (sdpa's guard for fully masked rows) -> ``p``."""
    w = view.producer_of(value, "Where")
    if w is None:
        return value
    isnan = view.producer_of(w.inputs[0], "IsNaN")
    if isnan is None or view.scalar(w.inputs[1]) != 0.0 or isnan.inputs[0] != w.inputs[2]:
        return value
    return w.inputs[2]


def _repeated(hq: int, transposed: bool) -> Callable[[np.ndarray], np.ndarray | None]:
    """What a view chain must compute from a KV tensor: ``repeat_kv`` to ``hq`` heads
    (transposed for the keys of ``q @ k^T``)."""

    def expect(ids: np.ndarray) -> np.ndarray | None:
        if hq % ids.shape[1]:
            return None
        rep = np.repeat(ids, hq // ids.shape[1], axis=1)
        return rep.swapaxes(2, 3) if transposed else rep

    return expect


def match_attention_matmul(view: OnnxView, node: OnnxNode) -> Match | None:
    """``MatMul(Softmax(scores), v')``; see the module docstring."""
    probs = _nan_guard(view, strip(view, node.inputs[0], ("Cast",)))
    sm = view.producer_of(probs, "Softmax")
    if sm is None or not last_axis(view, sm) or view.rank(probs) != 4:
        return None
    value, scale, mask = sm.inputs[0], 1.0, None
    while True:
        p = view.producer.get(value)
        sf = scalar_factor(view, p) if p is not None else None
        if p is None:
            return None
        if sf is not None:
            scale *= sf[1]
            value = sf[0]
        elif p.op_type == "Cast" and view.dtypes.get(p.inputs[0]) in ("fp32", "fp16", "bf16"):
            value = p.inputs[0]
        elif p.op_type == "Add" and mask is None:
            i = 0 if _reaches_matmul(view, p.inputs[0]) else 1
            value, mask = p.inputs[i], p.inputs[1 - i]
        elif p.op_type == "MatMul":
            break
        else:
            return None
    qk = view.producer_of(value, "MatMul")
    assert qk is not None
    q, qs = _cut(view, qk.inputs[0], lambda ids: ids)
    hq = _heads(view, q)
    k, ks = _cut(view, qk.inputs[1], _repeated(hq, True))
    v, _ = _cut(view, node.inputs[1], _repeated(hq, False))
    if view.shape(v) is None or _heads(view, v) != _heads(view, k):
        raise Unsupported("k and v have different numbers of heads")
    causal, kvl = False, None
    if mask is not None:
        b, _, s, _, length = _sizes(view, q, k)
        causal, kvl = mask_kind(view, mask, b, s, length)
    op = L.Attention(hq, _heads(view, k), float(scale * qs * ks), causal)
    out = node.outputs[0]
    ins = [q, k, v] + ([kvl] if kvl else [])

    def emit(em: Emitter) -> None:
        em.emit1(op, [em.get(x) for x in ins], out, source=node.source)

    return Match("attention_matmul_softmax", ins, [out], emit, {"op": op})


def _kv_operand(view: OnnxView, value: str, hq: int) -> tuple[str, float]:
    """A K/V input of the Attention op: ``repeat_kv`` of a tensor, or the tensor itself (the op
    broadcasts KV heads over query groups)."""
    try:
        return _cut(view, value, _repeated(hq, False))
    except Unsupported:
        return _cut(view, value, lambda ids: ids if hq % ids.shape[1] == 0 else None)


def match_attention_op(view: OnnxView, node: OnnxNode) -> Match | None:
    """Opset-23 ``Attention(Q, K, V[, attn_mask, past_key, past_value])`` on 4-D inputs."""
    q, k, v = node.inputs[:3]
    opt = list(node.inputs[3:]) + [""] * 4
    mask, past_k, past_v, nonpad = opt[0], opt[1], opt[2], opt[3]
    if view.rank(q) != 4:
        raise Unsupported("Attention on 3-D inputs; export with 4-D [B, heads, S, d] q/k/v")
    if float(node.attr("softcap", 0.0)):
        raise Unsupported("Attention with softcap has no layer op")
    if nonpad:
        raise Unsupported("Attention with nonpad_kv_seqlen; pass a KV-length mask instead")
    if len(node.outputs) > 3 and node.outputs[3] and view.users(node.outputs[3]):
        raise Unsupported("the attention scores output (qk_matmul_output) is used")
    d = (view.shape(q) or (None,) * 4)[3]
    scale = node.attr("scale")
    if scale is None:
        if not isinstance(d, int):
            raise Unsupported("Attention without scale and a dynamic head size")
        scale = 1.0 / math.sqrt(d)
    hq = _heads(view, q)
    if not past_k:  # sdpa with a mask repeats the KV heads before the op
        k, ks = _kv_operand(view, k, hq)
        v, vs = _kv_operand(view, v, hq)
        if ks != 1.0 or vs != 1.0:
            raise Unsupported("scaled k or v in front of the Attention op")
    hkv = _heads(view, k)
    qshape, kshape = view.shape(q), view.shape(k)
    causal, kvl = bool(node.attr("is_causal", 0)), None
    if causal:
        total = kshape[2] if not past_k else None  # type: ignore[index]
        if total is None or qshape is None or qshape[2] != total:
            raise Unsupported(
                "ONNX Attention's is_causal aligns queries to the first keys; it is supported "
                "when the query and key lengths are equal (prefill without a cache)"
            )
    if mask:
        b, _, s, _, length = _sizes(view, q, k)
        if past_k:
            length += concrete((view.shape(past_k) or (None,) * 4)[2], view.sample_dims())
        c2, kvl = mask_kind(view, mask, b, s, length)
        causal = causal or c2
    op = L.Attention(hq, hkv, float(scale), causal)
    outs = [o for o in node.outputs[:3]]
    ins = [q, k, v] + [x for x in (past_k, past_v) if x] + ([kvl] if kvl else [])

    def emit(em: Emitter) -> None:
        kk, vv = em.get(k), em.get(v)
        if past_k:
            kk = em.emit1(L.Concat(2), [em.get(past_k), kk], outs[1] or None, source=node.source)
            vv = em.emit1(L.Concat(2), [em.get(past_v), vv], outs[2] or None, source=node.source)
        args = [em.get(q), kk, vv] + ([em.get(kvl)] if kvl else [])
        em.emit1(op, args, outs[0], source=node.source)

    return Match("attention_op", ins, [o for o in outs if o], emit, {"op": op})


ATTENTION_PATTERNS: tuple[CommonPattern, ...] = (
    onnx_pattern(
        Pattern("attention_op", frozenset({"Attention"}), match_attention_op, "opset-23 Attention")
    ),
    onnx_pattern(
        Pattern(
            "attention_matmul_softmax",
            frozenset({"MatMul"}),
            match_attention_matmul,
            "softmax(q k^T * scale + mask) v with repeat_kv",
        )
    ),
)
