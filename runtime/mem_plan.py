"""Per-operation plans of Load and Store: what a region's HBM request needs, worked out once.

A Load or Store names a region of a tensor (:class:`lowering.isa.Region`); the request it makes
is the region's ``(channel, bytes)`` split over the HBM channels (:meth:`runtime.layout.HbmLayout.split`,
ELK §2.1 / §6.1: tensors interleaved over the channels) and its byte count.  The operation keeps a
*plan* (:attr:`runtime.ops_mem.OpMem.plan`) built the first time it runs:

* a constant region (``fixed``): its split and byte count, final;
* a region whose extents are constant and whose starts are affine in registers (a tile loop):
  a function of the register file, generated once per distinct region form, that returns the
  starts (or ``None`` when the region leaves the tensor: the caller then raises the error the
  general path raises) and the byte offset of the region's first element from the tensor's
  base, plus a per-operation cache of splits by that offset modulo the interleave round (the
  layout's own cache key, :mod:`runtime.layout`);
* anything else: ``None``, the general path (:func:`runtime.mem_plan._region`).

:func:`_request` gives a handler its request from the plan, or by the general rule
(:func:`_region`, also the untimed replay's).  A plan records the
:class:`~runtime.layout.TensorInfo` it was made for, so an operation bound to
another tensor (a layer copy, :mod:`runtime.program_layers`) makes a new one.  The values are
those of the general path, so cycles, statistics and traces are unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.layout import TensorInfo
from runtime.ops import ev

__all__ = ["MemPlan", "mem_plan", "_region", "_request", "_slices"]

#: ``(info, starts_fn, fixed_starts, extents, elements, bytes, split_or_cache)``: see
#: :func:`mem_plan` (``starts_fn is None``: a constant region, ``split_or_cache`` its split)
MemPlan = tuple

#: region form (without the starts' constants) -> generated factory ``make(*constants)`` of
#: ``fn(regs) -> (starts, offset) | None`` (shared by operations)
_FNS: dict[tuple, Any] = {}


def mem_plan(layout: Any, op: Any, info: TensorInfo) -> MemPlan | None:
    """The plan of Load / Store ``op`` on tensor ``info`` (module docstring), or ``None``."""
    eb = info.elem_bytes
    if op.fixed is not None:
        starts, extents = op.fixed
        n = math.prod(extents)
        return (info, None, starts, extents, n, n * eb, layout.split(info, starts, extents))
    extents = op.cext
    if extents is None or op.starts is None:
        return None
    shape = info.shape
    if any(e < 0 or e > d for e, d in zip(extents, shape)):
        return None  # always outside: the general path raises
    # the form without the starts' constant terms: one generated factory serves every
    # operation that differs only in them (e.g. each core's share of a tensor)
    key = (tuple(terms for _, terms in op.starts), extents, shape, info.strides, eb)
    make = _FNS.get(key)
    if make is None:
        make = _FNS[key] = _starts_fn(op.starts, extents, shape, info.strides, eb)
    n = math.prod(extents)
    return (info, make(*[const for const, _ in op.starts]), None, extents, n, n * eb, {})


def _starts_fn(starts: tuple, extents: tuple, shape: tuple, strides: tuple, eb: int) -> Any:
    """``make(c0, c1, ...)``: a factory of ``fn(regs)``, the region's starts (compiled
    expressions ``starts`` evaluated in dimension order, as :func:`runtime.ops.ev` does, with
    the constant terms ``c0, c1, ...``) and their byte offset ``eb * sum(start * stride)``, or
    ``None`` when a start puts the region outside the tensor."""
    consts = ", ".join(f"c{j}" for j in range(len(starts)))
    lines = [f"def make({consts}):", "    def fn(regs):"]
    names = []
    for j, (_, terms) in enumerate(starts):
        expr = " + ".join([f"c{j}"] + [f"{coef!r} * regs[{reg!r}]" for reg, coef in terms])
        lines.append(f"        s{j} = {expr}")
        names.append(f"s{j}")
    for j in range(len(starts)):
        lines.append(
            f"        if s{j} < 0 or s{j} > {shape[j] - extents[j]}:\n            return None"
        )
    off = " + ".join(f"{strides[j] * eb} * s{j}" for j in range(len(starts))) or "0"
    tup = ", ".join(names) + ("," if len(names) == 1 else "")
    lines.append(f"        return ({tup}), {off}")
    lines.append("    return fn")
    scope: dict[str, Any] = {}
    exec("\n".join(lines), scope)  # noqa: S102 - generated from integers and register names
    return scope["make"]


def _region(sim: Any, core: Any, op: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if op.fixed is not None:
        return op.fixed
    regs = core.regs
    starts = []
    for v, terms in op.starts:  # ev() inlined: one call per region, not per operand
        for name, coef in terms:
            v += coef * regs[name]
        starts.append(v)
    starts = tuple(starts)
    extents = op.cext
    if extents is None:
        extents = tuple([ev(regs, e) for e in op.extents])
    shape = op.info.shape
    for s, e, d in zip(starts, extents, shape):
        if s < 0 or e < 0 or s + e > d:
            raise sim.error(
                core,
                f"region starts={starts} extents={extents} is outside tensor {op.info.name!r} "
                f"of shape {shape} (registers {dict(sorted(regs.items()))})",
            )
    return starts, extents


def _request(sim: Any, core: Any, op: Any, info: TensorInfo) -> tuple:
    """``(starts, extents, elements, bytes, split)`` of ``op``'s request now: from its plan
    (:mod:`runtime.mem_plan`) or, where it has none, by the general rule."""
    plan = op.plan
    if plan is None or plan[0] is not info:
        plan = op.plan = mem_plan(sim.layout, op, info) or (info,)
    if len(plan) == 1:  # no plan: the general rule
        starts, extents = _region(sim, core, op)
        n = math.prod(extents)
        return starts, extents, n, n * info.elem_bytes, sim.layout.split(info, starts, extents)
    _, fn, starts, extents, n, nbytes, split = plan
    if fn is not None:
        got = fn(core.regs)
        if got is None:
            _region(sim, core, op)  # raises: outside the tensor
        starts, off = got
        cache = split
        key = (info.base + off) % sim.layout.round
        split = cache.get(key)
        if split is None:
            split = cache[key] = sim.layout.split(info, starts, extents)
    return starts, extents, n, nbytes, split


def _slices(starts: tuple, extents: tuple) -> tuple:
    return tuple(slice(s, s + e) for s, e in zip(starts, extents))
