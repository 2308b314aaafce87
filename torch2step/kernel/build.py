"""HBM tensors of an ELK schedule and its per-core programs.

``bind_timing`` gives every operator of a shapes-only list (no weights: timing mode) its own
input, preloaded and output tensors; the layer-graph path (:mod:`torch2step.kernel.graph`) binds
real values instead.  Matrix weights are declared in the tile-major layout of the chosen plan
(:func:`lowering.elk_programs.tile_major`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from elk.cost import Plan
from elk.ops import Operator
from elk.plan import ElkSchedule
from hwmodel.chip import Chip
from lowering.elk_programs import elk_programs, weight_shape
from lowering.isa import ProgramSet
from runtime import gc_paused

__all__ = ["bind_timing", "build_programs", "Tensors"]

Tensors = dict[str, tuple[tuple[int, ...], str]]


def _shapes(op: Operator, plan: Plan) -> dict[str, tuple[int, ...]]:
    if op.kind == "matmul":
        m, k, n = op.dims
        return {"x": (m, k), "w": weight_shape(op, plan), "y": (m, n)}
    if op.kind == "attention":
        b, hq, hkv, d, length = op.dims
        return {
            "q": (b, hq, d),
            "kc": (b, hkv, length, d),
            "vc": (b, hkv, length, d),
            "o": (b, hq, d),
        }
    return {"x": op.dims, "y": op.dims}


def bind_timing(ops: Sequence[Operator], plans: Sequence[Plan]) -> tuple[list[Operator], Tensors]:
    """Operators with a tensor per role, and the tensor declarations."""
    out: list[Operator] = []
    tensors: Tensors = {}
    for op, plan in zip(ops, plans):
        roles = []
        for role, shape in _shapes(op, plan).items():
            name = f"{op.name}.{role}"
            tensors[name] = (shape, op.dtype)
            roles.append((role, name))
        out.append(dataclasses.replace(op, tensors=tuple(roles)))
    return out, tensors


def build_programs(
    sched: ElkSchedule,
    chip: Chip,
    ops: Sequence[Operator] | None = None,
    tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
) -> ProgramSet:
    """The per-core programs of ``sched`` (operators bound to tensors, or bound for timing)."""
    if ops is None or tensors is None:
        ops, tensors = bind_timing(sched.ops, sched.plans)
    with gc_paused():  # millions of acyclic instructions on a large chip
        return elk_programs(
            chip, ops, sched.plans, sched.order, sched.issued, tensors, name=f"elk_{sched.design}"
        )
