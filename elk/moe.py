"""Dynamic MoE under ELK (ELK §7 "Apply ELK to MoE", left there as future work).

A routed expert's weights can be preloaded only once the routing that selects it has executed,
at the runtime expert indices; the plan is made for a generic expert group of the expected
active size (experts no token picks are never loaded).  :func:`dynamic_vs_dense` plans the same
decode step twice — once with that constraint, once as a dense MLP of the same active size
whose weights are known ahead — and reports how much preload/execute overlap the routing
dependency loses or keeps.
"""

from __future__ import annotations

from typing import Any

from elk.cost import ChipCosts
from elk.errors import ElkError
from elk.ops import DECODERS, decode_step_ops
from elk.plan import ElkSchedule, plan_model
from hwmodel.chip import Chip

__all__ = ["dynamic_vs_dense"]


def _terms(s: ElkSchedule) -> dict[str, float]:
    b = s.breakdown()
    return {
        "cycles": round(s.cycles),
        # execution and preload both progressing; an execute stalled behind the preloads on
        # its ports or HBM channels is the ``interconnect`` term, not overlap (ELK §6.2)
        "overlapped": round(b["overlapped"]),
        "interconnect": round(b["interconnect"]),
        "preload_only": round(b["preload"]),
        "hbm_util": round(s.hbm_utilisation(), 4),
    }


def dynamic_vs_dense(
    model: str,
    batch: int,
    kv_len: int,
    chip: Chip | ChipCosts,
    *,
    layers: int | None = None,
    design: str = "elk_full",
    **plan_kw: Any,
) -> dict[str, Any]:
    """Plan ``model``'s decode step with routed experts preloaded after their routing and as a
    dense MLP of the same active size; the overlap kept is the ratio of the overlapped
    preload/execute time of the two."""
    if not DECODERS[model].experts:
        raise ElkError(f"{model!r} has no routed experts; choose a MoE model")
    dyn = plan_model(
        decode_step_ops(model, batch, kv_len, layers, dynamic=True), chip, design, **plan_kw
    )
    dense = plan_model(decode_step_ops(model, batch, kv_len, layers), chip, design, **plan_kw)
    d, s = _terms(dyn), _terms(dense)
    return {
        "model": model,
        "batch": batch,
        "kv_len": kv_len,
        "design": design,
        "dynamic": d,
        "dense": s,
        "slowdown": round(d["cycles"] / s["cycles"], 4) if s["cycles"] else None,
        "overlap_kept": round(d["overlapped"] / s["overlapped"], 4) if s["overlapped"] else None,
    }
