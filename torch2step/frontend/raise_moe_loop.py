"""Raising a user-written loop over experts into one
:class:`~torch2step.layers.ops.MoEExperts`, by what it computes rather than how it is spelled.

``for e in range(E)`` the loop finds the tokens routed to expert ``e``, gathers them, runs the
expert, scales by the routing weight and accumulates into a zero buffer.  Every step has
several spellings, all accepted:

- tokens: ``torch.where(ids == e)``, ``(ids == e).nonzero()`` (columns), ``nonzero(as_tuple=
  True)``, ``(ids == e).any(-1).nonzero()`` or ``torch.where(mask.any(-1))`` (any function of
  the ``ids == e`` mask whose ``nonzero`` gives the token rows);
- gather: ``x[tok]``, ``x.index_select(0, tok)``, ``torch.gather(x, 0, tok[:, None].expand(...))``;
- weight: ``w[tok, slot]``, ``(w * mask).sum(-1)[tok]`` or any expression of the ``[T, k]``
  routing weights;
- accumulate: ``index_add_``, ``scatter_add_`` (a row index expanded over the hidden dim),
  ``index_put_(..., accumulate=True)``;
- expert: gated or plain two-matrix MLP, SiLU / GELU / ReLU, with or without biases
  (:func:`~torch2step.frontend.raise_moe_body.expert_body`).

The anchors found this way (tokens, routing weights, expert ids) are then confirmed by running
the region on random tokens and routings against the op's definition
(:func:`~torch2step.frontend.raise_moe_body.moe_match`).  Per-expert routing is what the STeP
MoE schedules work on (STeP, arXiv 2511.07776, §5.2 dynamic tiling of each expert's token
batch, §5.3 configuration time-multiplexing).
"""

from __future__ import annotations

from collections import deque

import sympy
import torch
from torch import fx

from torch2step.frontend.fx_pattern import Match, NoMatch, Pattern
from torch2step.frontend.fx_view import ProgramView, op_name, raw_shape, strip, strip_casts
from torch2step.frontend.raise_moe_body import (
    MoESpec,
    Proj,
    describe_body,
    expert_body,
    expert_tensors,
    moe_match,
    weight_sources,
)

__all__ = ["MOE_LOOP", "MOE_LOOP_ANCHORS"]

MOE_LOOP_ANCHORS = frozenset(
    {"index_put", "index_put_", "index_add", "index_add_", "scatter_add", "scatter_add_"}
)
_ZEROS = frozenset({"full_like", "full", "zeros_like", "zeros", "new_zeros"})
#: Ops that pick rows or columns of ``nonzero``'s result without changing what it means.
_PICK = frozenset({"select", "slice", "squeeze", "unsqueeze", "view", "_unsafe_view", "reshape",
                   "getitem", "alias", "clone", "_to_copy", "expand"})  # fmt: skip
_EXPERT_FORMS = (
    "experts must be down(act(gate(x)) * up(x)) or down(act(up(x))) with act one of silu, "
    "gelu, relu, each projection a linear map with or without a bias"
)


def _proj_mm(view: ProgramView, node: fx.Node) -> Proj | None:
    """``x @ W^T`` as ``mm(x, W^T)``, or ``addmm(b, x, W^T)`` (``F.linear`` with a bias)."""
    n = strip_casts(node)
    if op_name(n) == "mm":
        w = view.const(n.args[1])
        if w is None or w.dim() != 2:
            return None
        return Proj(strip_casts(n.args[0]), w.t(), None, n.args[1])
    if op_name(n) == "addmm" and n.kwargs.get("beta", 1) == 1 and n.kwargs.get("alpha", 1) == 1:
        w, b = view.const(n.args[2]), view.const(n.args[0])
        if w is None or b is None or w.dim() != 2 or b.numel() != w.shape[1]:
            return None
        return Proj(strip_casts(n.args[1]), w.t(), None, n.args[2], b.reshape(-1))
    return None


def _row_index(node: fx.Node) -> fx.Node | None:
    """``tok`` when ``node`` is ``tok[:, None].expand(-1, H)`` (a ``scatter``/``gather`` index
    selecting whole rows)."""
    n = strip(node)
    if op_name(n) != "expand":
        return None
    u = strip(n.args[0])
    if op_name(u) == "unsqueeze" and u.args[1] in (1, -1):
        return strip(u.args[0])
    if op_name(u) in ("view", "_unsafe_view", "reshape") and len(raw_shape(u)) == 2:
        return strip(u.args[0])
    return None


def _steps(node: fx.Node) -> tuple[list[tuple[fx.Node, fx.Node]], fx.Node]:
    """The accumulations ending at ``node`` as ``(token rows, contribution)`` and the buffer
    they start from."""
    steps = []
    cur = strip(node)
    while True:
        name = op_name(cur)
        if name in ("index_put", "index_put_") and len(cur.args) > 3 and cur.args[3] is True:
            if len(cur.args[1]) != 1 or cur.args[1][0] is None:
                break
            steps.append((cur.args[1][0], cur.args[2]))
        elif name in ("index_add", "index_add_") and cur.args[1] == 0:
            if cur.kwargs.get("alpha", 1) != 1:
                break
            steps.append((cur.args[2], cur.args[3]))
        elif name in ("scatter_add", "scatter_add_") and cur.args[1] == 0:
            tok = _row_index(cur.args[2])
            if tok is None:
                break
            steps.append((tok, cur.args[3]))
        else:
            break
        cur = strip(cur.args[0])
    return steps, cur


def _nonzero_of(node: fx.Node) -> fx.Node | None:
    """The ``nonzero`` whose rows ``node`` picks (``torch.where`` columns, squeezes, views)."""
    n = strip(node)
    for _ in range(8):
        if op_name(n) == "nonzero":
            return n
        if op_name(n) not in _PICK or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = strip(n.args[0])
    return None


def _expert_of(nz: fx.Node) -> tuple[fx.Node, int] | None:
    """``(ids, e)`` when ``nz`` is ``nonzero`` of a function of ``ids == e`` (the mask itself,
    ``mask.any(-1)``, a cast, ...): the nearest ``eq`` with an integer among its inputs."""
    queue, seen = deque([nz.args[0]]), set()
    while queue and len(seen) < 12:
        n = strip(queue.popleft())
        if not isinstance(n, fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if op_name(n) == "eq" and isinstance(n.args[1], int):
            return strip(n.args[0]), n.args[1]
        queue.extend(a for a in n.args if isinstance(a, fx.Node))
    return None


def _gathered(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, tok)`` when ``node`` gathers rows ``tok`` of ``x``: ``x[tok]``,
    ``index_select(x, 0, tok)`` or ``gather(x, 0, tok[:, None].expand(...))``."""
    n = strip(node)
    name = op_name(n)
    if name == "index" and len(n.args[1]) == 1 and n.args[1][0] is not None:
        return strip(n.args[0]), strip(n.args[1][0])
    if name == "index_select" and n.args[1] == 0:
        return strip(n.args[0]), strip(n.args[2])
    if name == "gather" and n.args[1] == 0:
        tok = _row_index(n.args[2])
        return (strip(n.args[0]), tok) if tok is not None else None
    return None


def _descendants(node: fx.Node) -> set[fx.Node]:
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(n.users)
    return out


def _routing_weights(
    view: ProgramView, wsel: fx.Node, ids: fx.Node, from_ids: set[fx.Node]
) -> fx.Node | None:
    """The routing weights ``w[T, k]`` an expert's scale is read from: the nearest floating
    ancestor of ``wsel`` shaped like ``ids`` that does not itself depend on ``ids``."""
    want = raw_shape(ids)
    queue, seen = deque([wsel]), set()
    while queue and len(seen) < 32:
        n = strip(queue.popleft())
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point and n not in from_ids:
            shape = raw_shape(n)
            if len(shape) == len(want) and all(
                sympy.expand(a - b) == 0 for a, b in zip(shape, want)
            ):
                return n
        if n.op == "call_function":
            queue.extend(a for a in n.args if isinstance(a, fx.Node))
            queue.extend(
                a for a in n.args if isinstance(a, (list, tuple)) for a in a
                if isinstance(a, fx.Node)
            )  # fmt: skip
    return None


def _num_experts(ids: fx.Node) -> int | None:
    if op_name(ids) == "getitem" and op_name(ids.args[0]) == "topk":
        e = raw_shape(strip(ids.args[0]).args[0])[-1]
        return e if isinstance(e, int) else None
    return None


def _match_loop(view: ProgramView, node: fx.Node) -> Match | None:
    if any(op_name(u) in MOE_LOOP_ANCHORS and u.args[0] is node for u in node.users):
        return None  # not the last accumulation of the loop
    steps, base = _steps(node)
    if len(steps) < 2 or op_name(base) not in _ZEROS:
        return None
    if op_name(base) in ("full_like", "full") and base.args[1] != 0:
        return None
    experts: dict[int, object] = {}
    found: set[tuple[fx.Node, fx.Node, fx.Node]] = set()
    from_ids: set[fx.Node] | None = None
    for tok, contrib in reversed(steps):  # in the loop's order
        nz = _nonzero_of(tok)
        ie = _expert_of(nz) if nz is not None else None
        if ie is None:
            return None
        ids, e = ie
        if e in experts:
            raise NoMatch(f"expert {e} is accumulated twice; every expert needs one step")
        from_ids = _descendants(ids) if from_ids is None else from_ids
        c = strip_casts(contrib)
        if op_name(c) != "mul":
            raise NoMatch(
                f"expert {e}'s result is not scaled by its routing weight (y * w) before it "
                "is accumulated"
            )
        for y, wsel in ((c.args[0], c.args[1]), (c.args[1], c.args[0])):
            if not isinstance(y, fx.Node) or not isinstance(wsel, fx.Node):
                continue
            body = expert_body(view, y, _proj_mm)
            g = _gathered(body.x) if body is not None else None
            if body is None or g is None or _nonzero_of(g[1]) is not nz:
                continue
            w = _routing_weights(view, wsel, ids, from_ids)
            if w is None:
                continue
            experts[e] = body
            found.add((g[0], w, ids))
            break
        else:
            raise NoMatch(
                f"{_EXPERT_FORMS}, applied to gathered token rows and scaled by the routing "
                f"weight; expert {e} computes {describe_body(view, c, _descendants(nz))}"
            )
    if len(found) != 1:
        raise NoMatch("the experts read different tokens, routing weights or expert ids")
    x, w, ids = found.pop()
    e = _num_experts(ids) or len(experts)
    if sorted(experts) != list(range(e)):
        raise NoMatch(
            f"the loop covers experts {sorted(experts)} of {e}; every expert needs its step"
        )
    bodies = [experts[i] for i in range(e)]
    acts = {b.activation for b in bodies}  # type: ignore[attr-defined]
    if len(acts) != 1:
        raise NoMatch(f"experts must share one activation; these use {sorted(acts)}")
    sources = [s for b in bodies for s in b.sources]  # type: ignore[attr-defined]
    spec = MoESpec(
        x, w, ids, expert_tensors(bodies), acts.pop(),  # type: ignore[arg-type]
        weight_sources(view, sources),
    )  # fmt: skip
    return moe_match(view, node, "moe_loop", spec)


MOE_LOOP = Pattern(
    "moe_loop",
    MOE_LOOP_ANCHORS,
    _match_loop,
    "for e in range(E): tokens of ids == e -> gather -> expert -> * w -> accumulate -> MoEExperts",
)
