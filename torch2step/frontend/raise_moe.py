"""Raising routed Mixture-of-Experts regions into one
:class:`~torch2step.layers.ops.MoEExperts` (after a ``TopKRouting`` router), whatever the
spelling (HuggingFace writes one MoE block three ways):

- ``moe_loop``: a user loop ``for e in range(E)`` in any of its spellings
  (:mod:`torch2step.frontend.raise_moe_loop`);
- ``moe_batched_mm``: HF ``batched_mm``: ``repeat_interleave`` of the tokens, ``W[ids]`` gathering a
  copy of the expert weights per (token, slot), ``bmm``, SwiGLU, ``bmm``, ``view + sum`` over the
  slots.  Lowered literally it would move ``T * k`` weight copies; raised, each expert's weights
  are read once for the tokens routed to it;
- ``moe_grouped_mm``: HF ``grouped_mm``: ``sort`` of the flattened ids, ``histc``/``cumsum``
  offsets, ``aten._grouped_mm``, ``transformers.grouped_mm_fallback`` or ``torch2step.grouped_mm``, and the inverse
  permutation built with ``index_put``.

Each matcher finds the anchors (tokens, routing weights, expert ids, weights); the region is then
run and compared with MoEExperts (:func:`~torch2step.frontend.raise_moe_body.moe_match`).
Data-dependent parts stay dynamic: the expert choice is an input of the op, never the example's.
Per-expert routing is what the STeP MoE schedules work on (STeP (arXiv 2511.07776) §5.2 dynamic tiling of each
expert's token batch, §5.3 configuration time-multiplexing of experts).
"""

from __future__ import annotations

from torch import fx

from torch2step.frontend.fx_pattern import Match, Pattern
from torch2step.frontend.fx_view import ProgramView, op_name, raw_shape, strip, strip_casts
from torch2step.frontend.raise_moe_body import (
    MoESpec,
    Proj,
    expert_body,
    expert_tensors,
    moe_match,
    weight_sources,
)

__all__ = ["MOE_BATCHED_MM", "MOE_GROUPED_MM"]

_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})
_ZEROS = frozenset({"full_like", "full", "zeros_like", "zeros", "new_zeros"})
_GROUPED = frozenset(
    {"transformers.grouped_mm_fallback", "torch2step.grouped_mm", "_grouped_mm", "grouped_mm"}
)


def _unsqueezed(node: fx.Node) -> fx.Node:
    n = strip_casts(node)
    while op_name(n) in ("unsqueeze",) or (op_name(n) in _VIEWS and n.args and _numel_same(n)):
        n = strip_casts(n.args[0])
    return n


def _numel_same(n: fx.Node) -> bool:
    """A view that only adds or removes size-1 dims."""
    a = [d for d in raw_shape(n) if d != 1]
    b = [d for d in raw_shape(n.args[0]) if d != 1]
    return len(a) == len(b) and all(x - y == 0 for x, y in zip(a, b))


# -- HF batched_mm ------------------------------------------------------------------------------
def _flat(node: fx.Node) -> fx.Node | None:
    """``t`` when ``node`` is ``t.reshape(-1)`` of a 2-D ``t``."""
    n = strip(node)
    if op_name(n) in _VIEWS and len(raw_shape(n)) == 1:
        return strip(n.args[0])
    return None


def _proj_bmm(view: ProgramView, node: fx.Node) -> Proj | None:
    n = strip_casts(node)
    if op_name(n) != "squeeze":
        return None
    bmm = strip(n.args[0])
    if op_name(bmm) != "bmm":
        return None
    a, b = (strip(x) for x in bmm.args[:2])
    for gathered, other, transposed in ((a, b, False), (b, a, True)):
        if op_name(gathered) != "index" or len(gathered.args[1]) != 1:
            continue
        w = view.const(gathered.args[0])
        if w is None or w.dim() != 3 or op_name(other) != "unsqueeze":
            continue
        w = w.transpose(1, 2) if transposed else w
        return Proj(strip_casts(other.args[0]), w, strip(gathered.args[1][0]), gathered.args[0])
    return None


def _unrepeat(node: fx.Node, k: int) -> fx.Node | None:
    """``x`` when ``node`` is ``x.repeat_interleave(k, dim=0)`` of a 2-D ``x``."""
    n = strip(node)
    if op_name(n) == "repeat_interleave":
        return strip(n.args[0])
    if op_name(n) not in _VIEWS:
        return None
    e = strip(n.args[0])
    if op_name(e) != "expand" or raw_shape(e)[1] != k:
        return None
    u = strip(e.args[0])
    if op_name(u) != "unsqueeze" or u.args[1] != 1:
        return None
    return strip(u.args[0])


def _slot_sum(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(y, k)`` when ``node`` is ``y.view(T, k, H).sum(1)``."""
    if op_name(node) != "sum" or list(node.args[1]) != [1]:
        return None
    if len(node.args) > 2 and node.args[2]:
        return None
    r = strip(node.args[0])
    if op_name(r) not in _VIEWS or len(raw_shape(r)) != 3:
        return None
    k = raw_shape(r)[1]
    return (strip(r.args[0]), k) if isinstance(k, int) else None


def _match_batched(view: ProgramView, node: fx.Node) -> Match | None:
    ss = _slot_sum(node)
    if ss is None:
        return None
    m, k = strip_casts(ss[0]), ss[1]
    if op_name(m) != "mul":
        return None
    a, b = m.args[:2]
    for y, ws in ((a, b), (b, a)):
        body = expert_body(view, y, _proj_bmm)
        w = _flat(_unsqueezed(ws)) if body is not None else None
        if body is None or w is None:
            continue
        flats = {strip(key) for key in body.keys}
        x = _unrepeat(body.x, k)
        ids = _flat(flats.pop()) if len(flats) == 1 else None
        if x is None or ids is None:
            continue
        spec = MoESpec(
            x, w, ids, expert_tensors([body]), body.activation,
            weight_sources(view, list(body.sources)),
        )  # fmt: skip
        return moe_match(view, node, "moe_batched_mm", spec)
    return None


MOE_BATCHED_MM = Pattern(
    "moe_batched_mm",
    frozenset({"sum"}),
    _match_batched,
    "HF batched_mm: W[ids] gathered per token -> bmm -> SwiGLU -> bmm -> view+sum -> MoEExperts",
)


# -- HF grouped_mm ------------------------------------------------------------------------------
def _proj_grouped(view: ProgramView, node: fx.Node) -> Proj | None:
    n = strip_casts(node)
    if op_name(n) not in _GROUPED:
        return None
    x, wt = n.args[0], n.args[1]
    offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
    w = view.const(wt)
    if w is None or w.dim() != 3:
        return None
    return Proj(strip_casts(x), w.transpose(1, 2), strip(offs), wt)


def _sorted_perm(node: fx.Node) -> fx.Node | None:
    """``ids`` when ``node`` is ``sort(ids.reshape(-1))[1]``."""
    n = strip(node)
    if op_name(n) != "getitem" or n.args[1] != 1 or op_name(n.args[0]) != "sort":
        return None
    return _flat(n.args[0].args[0])


def _match_grouped(view: ProgramView, node: fx.Node) -> Match | None:
    ss = _slot_sum(node)
    if ss is None:
        return None
    g = strip(ss[0])
    if op_name(g) != "index" or len(g.args[1]) != 1:
        return None
    m = strip_casts(g.args[0])
    if op_name(m) != "mul":
        return None
    a, b = m.args[:2]
    for y, ws in ((a, b), (b, a)):
        body = expert_body(view, y, _proj_grouped)
        if body is None:
            continue
        gathered = _unsqueezed(ws)
        if op_name(gathered) != "index" or len(gathered.args[1]) != 1:
            continue
        w = _flat(gathered.args[0])
        ids = _sorted_perm(gathered.args[1][0])
        xs = strip(body.x)
        if w is None or ids is None or op_name(xs) != "index" or len(xs.args[1]) != 1:
            continue
        spec = MoESpec(
            strip(xs.args[0]), w, ids, expert_tensors([body]), body.activation,
            weight_sources(view, list(body.sources)),
        )  # fmt: skip
        return moe_match(view, node, "moe_grouped_mm", spec)
    return None


MOE_GROUPED_MM = Pattern(
    "moe_grouped_mm",
    frozenset({"sum"}),
    _match_grouped,
    "HF grouped_mm: sort/histc/cumsum -> grouped_mm -> SwiGLU -> grouped_mm -> unsort -> MoEExperts",
)
