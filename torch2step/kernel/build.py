"""HBM tensors of an ELK schedule and its per-core programs.

``bind_timing`` gives every operator of a shapes-only list (no weights: timing mode) its own
input, preloaded and output tensors; the layer-graph path (:mod:`torch2step.kernel.graph`) binds
real values instead.  Matrix weights are declared in the tile-major layout of the chosen plan
(:func:`lowering.elk_placement.tile_major`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from elk.cost import Plan
from elk.ops import Operator
from elk.plan import ElkSchedule
from hwmodel.chip import Chip
from lowering.elk_placement import weight_shape
from lowering.elk_programs import elk_programs
from lowering.isa import ProgramSet
from runtime import gc_paused

__all__ = ["bind_timing", "build_programs", "timing_links", "Tensors"]

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


_IN = {"matmul": "x", "attention": "q", "vector": "x"}
_OUT = {"matmul": "y", "attention": "o", "vector": "y"}


def _flat(shape: Sequence[int]) -> tuple[int, int]:
    return (shape[0], math.prod(shape[1:]))


def timing_links(
    ops: Sequence[Operator], tensors: Mapping[str, tuple[tuple[int, ...], str]]
) -> dict[str, str]:
    """Operator ``i``'s input activation is operator ``i-1``'s output (ELK §4.5: activations
    stay on chip) when, seen as ``(rows, columns)`` matrices, it is the output's leading
    columns (the rotary step reads the query and key columns of the QKV projection; the
    planner times the other inputs as HBM reads by the same rule, :func:`elk.ops.input_on_chip`)."""
    links: dict[str, str] = {}
    for prev, op in zip(ops, ops[1:]):
        roles, before = dict(op.tensors), dict(prev.tensors)
        src, dst = before.get(_OUT[prev.kind]), roles.get(_IN[op.kind])
        if src is None or dst is None:
            continue
        (r0, c0), (r1, c1) = _flat(tensors[src][0]), _flat(tensors[dst][0])
        if r0 == r1 and c1 <= c0 and tensors[src][1] == tensors[dst][1]:
            links[dst] = src
    return links


def build_programs(
    sched: ElkSchedule,
    chip: Chip,
    ops: Sequence[Operator] | None = None,
    tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
    results: Sequence[str] = (),
) -> ProgramSet:
    """The per-core programs of ``sched`` (operators bound to tensors, or bound for timing);
    ``results`` are stored to HBM even when a later operator reads them on chip."""
    links: dict[str, str] = {}
    if ops is None or tensors is None:
        ops, tensors = bind_timing(sched.ops, sched.plans)
        links = timing_links(ops, tensors)
    with gc_paused():  # millions of acyclic instructions on a large chip
        return elk_programs(
            chip,
            ops,
            sched.plans,
            sched.order,
            sched.issued,
            tensors,
            name=f"elk_{sched.design}",
            links=links,
            results=results,
        )
