"""The PyTorch spellings of an expert projection, for the MoE recogniser of both frontends
(:mod:`torch2step.frontend.raise_moe_region`).  A MoE block is written three ways:

- ``moe_batched_mm``: HF ``batched_mm``: ``repeat_interleave`` of the tokens, ``W[ids]`` gathering a
  copy of the expert weights per (token, slot), ``bmm``, SwiGLU, ``bmm``, ``view + sum`` over the
  slots.  Lowered literally it would move ``T * k`` weight copies; raised, each expert's weights
  are read once for the tokens routed to it;
- ``moe_grouped_mm``: HF ``grouped_mm``: ``sort`` of the flattened ids, ``histc``/``cumsum``
  offsets, ``aten._grouped_mm``, ``transformers.grouped_mm_fallback`` or
  ``torch2step.grouped_mm``, and the inverse permutation built with ``index_put``;
- ``moe_loop``: a user loop ``for e in range(E)``, each projection ``mm`` / ``addmm`` (``F.linear``
  or ``nn.Linear``) with one expert's weight.  The tokens of ``ids == e`` may be found with
  ``torch.where``, ``nonzero`` (columns or ``as_tuple``) or of ``mask.any(-1)``, gathered with
  ``x[tok]``, ``index_select`` or ``gather``, scaled by ``w[tok, slot]`` or ``(w * mask).sum(-1)``
  and accumulated with ``index_add_``, ``scatter_add_`` or ``index_put_(accumulate=True)``: none of
  that is matched, the region computes it.

The region is found from the router and run against MoEExperts
(:func:`~torch2step.frontend.raise_moe_body.moe_match`); only the projection is spelled here.
Data-dependent parts stay dynamic: the expert choice is an input of the op, never the example's.
Per-expert routing is what the STeP MoE schedules work on (STeP (arXiv 2511.07776) §5.2 dynamic
tiling of each expert's token batch, §5.3 configuration time-multiplexing of experts).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from torch2step.frontend.fx_pattern import Pattern
from torch2step.frontend.fx_view import ProgramView, op_name, strip, strip_casts
from torch2step.frontend.raise_moe_body import Proj, ProjFn
from torch2step.frontend.raise_moe_region import moe_region_pattern

__all__ = ["MOE_EXPERTS"]

_GROUPED = frozenset(
    {"transformers.grouped_mm_fallback", "torch2step.grouped_mm", "_grouped_mm", "grouped_mm"}
)


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


def _proj_mm(view: ProgramView, node: fx.Node) -> Proj | None:
    """One expert's ``x @ W^T`` in a loop: ``mm(x, W^T)``, or ``addmm(b, x, W^T)``
    (``F.linear`` with a bias)."""
    n = strip_casts(node)
    name = op_name(n)
    if name == "addmm" and (n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)) != (1, 1):
        return None
    if name not in ("mm", "addmm"):
        return None
    w = view.const(n.args[-1])
    b = view.const(n.args[0]) if name == "addmm" else None
    if w is None or w.dim() != 2 or (name == "addmm" and (b is None or b.numel() != w.shape[1])):
        return None
    bias = None if b is None else b.reshape(-1)
    return Proj(strip_casts(n.args[-2]), w.t(), None, n.args[-1], bias)


def _projections(view: Any, region: set[Any]) -> ProjFn:
    return lambda v, n: _proj_bmm(v, n) or _proj_grouped(v, n) or _proj_mm(v, n)


#: HF ``batched_mm`` and ``grouped_mm``, and user loops over experts (``moe_loop``).
MOE_EXPERTS: Pattern = moe_region_pattern(_projections)
