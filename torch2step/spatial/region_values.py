"""An expert region's control values computed in registers (STeP arXiv 2511.07776 §5.3).

With ``R`` regions each region learns which expert a chunk holds from the one-hot selector its
EagerMerge sends with the chunk, and computes from it the addresses of that expert's weight
tiles, which a RandomOffChipLoad reads ("RandomOffChipLoads which use the Selector from
EagerMerge to fetch the appropriate tiled weight", :mod:`torch2step.lower.blocks.moe_lanes`).
The selector is a control value (a bitmask) the units receive into registers; this module
gives the tile functions on that path a *register lowering* (:data:`~.control.REGISTER_FNS`),
so the values they send are computed at run time from the received registers, not the run's
literals, and their programs are the same whatever chunk each slot of the merge holds:

* ``selector_index`` — the index of the one-hot mask's bit: a binary search of ten steps
  (``Calc`` floordiv by ``2^512, 2^256, ..., 2``), masks up to 1024 inputs (a merge over the
  128 experts of Qwen3-30B-A3B sends masks wider than 64 bits);
* ``affine`` — ``scale * x + offset`` as an :class:`~lowering.isa.Affine` of the register;
* ``pad_index`` — ``n`` for a padding row, else the index (``If`` on the padding flag's
  register); ``get`` of a tuple's control value (the padding flag zipped to a row) — its
  register;
* the FlatMap ``tile_grid`` (:func:`emit_value_grid`) — each weight-tile address
  ``start + r*row_stride + c*col_stride`` as an ``Affine`` of the start's register.

Control instructions take no cycle (``Calc`` / ``Set`` / ``If``); the unit steps, messages and
bytes are those of the literal programs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy as sp

from lowering.isa import Affine, Calc, Cond, If, Set
from torch2step.lower.blocks.moe_lanes import MAX_SELECTOR_INPUTS
from torch2step.step.graph import Program as StepProgram
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import FlatMap
from torch2step.step.ops_routing import EagerMerge

from .context import EmitCtx
from .control import REGISTER_FNS, control_data
from .streams import Part, iter_nodes
from .unit import Elem, UnitBuilder
from .unit_reuse import FORM

__all__ = ["emit_value_grid", "ragged_bounds"]


_SELECTOR_BITS = MAX_SELECTOR_INPUTS
"""The widest one-hot selector :func:`_selector_index` decodes (inputs of an EagerMerge)."""
_SEARCH_SHIFTS = tuple(1 << k for k in reversed(range(_SELECTOR_BITS.bit_length() - 1)))
"""The binary search's shifts: ``512, 256, ..., 1``."""


def _reg(elem: Elem, i: int = 0) -> str | None:
    """The register holding value part ``i`` of ``elem`` (``None``: not a received value)."""
    if len(elem) <= i:
        return None
    part, reg = elem[i]
    return reg if part.kind == "value" and reg is not None else None


def _selector_index(b: UnitBuilder, f: Any, elem: Elem, part: Part) -> str | None:
    """``selector_index``: the position of the one bit of a one-hot mask (binary search)."""
    src = _reg(elem)
    if src is None or len(elem) != 1:
        return None
    m, t, r = "six.m", "six.t", "six.r"
    b.emit(Set(m, src), Set(r, 0))
    for s in _SEARCH_SHIFTS:
        b.emit(
            Calc(t, "floordiv", m, 1 << s),
            If(Cond(t, ">", 0), (Set(r, Affine(s, ((r, 1),))), Set(m, t))),
        )
    return r


def _affine(b: UnitBuilder, f: Any, elem: Elem, part: Part) -> str | None:
    """``affine(scale, offset)`` of a ``[1, 1]`` value received into a register."""
    src = _reg(elem)
    scale, offset = f.get("scale", 1), f.get("offset", 0)
    if src is None or len(elem) != 1 or not isinstance(scale, int) or not isinstance(offset, int):
        return None
    b.emit(Set("aff", Affine(offset, ((src, scale),)) if scale else offset))
    return "aff"


def _pad_index(b: UnitBuilder, f: Any, elem: Elem, part: Part) -> str | None:
    """``pad_index(n)``: ``n`` when the padding flag's register is set, else the index."""
    idx, pad = _reg(elem, 0), _reg(elem, 1)
    n = f.get("n")
    if idx is None or pad is None or len(elem) != 2 or not isinstance(n, int):
        return None
    b.emit(If(Cond(pad, "!=", 0), (Set("pidx", n),), (Set("pidx", idx),)))
    return "pidx"


def _get(b: UnitBuilder, f: Any, elem: Elem, part: Part) -> str | None:
    """``get(index)`` of a tuple whose ``index``-th part is a control value received into a
    register (a static tile's padding flag zipped to its rows): that register."""
    i = f.get("index")
    if not isinstance(i, int) or i >= len(elem):
        return None
    return _reg(elem, i)


REGISTER_FNS.update(
    {"selector_index": _selector_index, "affine": _affine, "pad_index": _pad_index, "get": _get}
)


def emit_value_grid(ctx: EmitCtx, b: UnitBuilder, op: Op) -> bool:
    """The unit of a FlatMap ``tile_grid`` whose start addresses arrive as control values:
    per start, one step per address, each computed from the start's register and sent from a
    register (module docstring), so the program is the same for every start.  ``False``
    (nothing emitted) when the unit is not such a grid or the graph's integer tiles carry no
    values (:func:`~.control.control_data`)."""
    if not isinstance(op, FlatMap) or getattr(op.fn, "name", None) != "tile_grid":
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    cfg = ctx.config(op)
    if cfg.reads_memory or cfg.writes_memory:
        return False
    if not ctx.region and not control_data(ctx.structure.graph):  # (control.lower_value)
        return False
    rows, cols = int(op.fn.get("rows")), int(op.fn.get("cols"))
    rs, cs = int(op.fn.get("row_stride")), int(op.fn.get("col_stride"))
    if any(len(x.parts(k)) != 1 or x.parts(k)[0].kind != "value" for k in range(len(x.flat))):
        return False
    depth = out.value.rank - x.value.rank + 1
    j = 0
    for k, val in enumerate(x.flat):
        e = b.recv(x, k)
        src = _reg(e)
        if src is None:  # pragma: no cover - a start generated locally
            return False
        produced = len(iter_nodes(op.fn.spec.impl(op.fn, val), depth))
        assert produced == rows * cols
        b.step()
        for r in range(rows):
            for c in range(cols):
                y = b.compute(1, (e,), out.parts(j))
                reg = f"grid.{r}.{c}"
                b.emit(Set(reg, Affine(r * rs + c * cs, ((src, 1),))))
                b.send(out, j, ((y[0][0], reg),))
                j += 1
                b.step()
    # the starts are read in registers, the addresses computed from them
    ctx.relax(op.input, FORM)
    ctx.relax(op.name, FORM)
    return True


def ragged_bounds(graph: StepProgram, bounds: Mapping[str, int]) -> dict[str, int]:
    """Per ragged chunk size of an expert region (by the name of its indexed base), a bound:
    the rows of the chunk an expert's ``as_ragged`` FlatMap makes are its token count, and a
    chunk an EagerMerge takes is one of its inputs' (STeP (revised) §3.1: a chunk's size is
    data-known), so at most the largest of their bounds (``bounds``: the Partition counts',
    :func:`~.plan.count_bounds`).  A region's tiles of a chunk's rows are then held in
    buffers allocated at that bound and timed from their run-time rows (:mod:`.rows`), the
    same program for every chunk size."""
    out: dict[str, int] = {}

    def of(d: Any) -> int | None:
        e = sp.sympify(d)
        if isinstance(e, sp.Indexed):
            return out.get(str(e.base))
        if e.is_Integer:
            return int(e)
        names = {x.name for x in e.free_symbols}
        if not names or not names <= bounds.keys():
            return None
        v = e.subs({x: bounds[x.name] for x in e.free_symbols})
        return int(v) if v.is_Integer else None

    for op, outs in zip(graph.nodes, graph.node_outputs):
        ragged = isinstance(op, EagerMerge) or (
            isinstance(op, FlatMap) and getattr(op.fn, "name", None) == "as_ragged"
        )
        if not ragged:
            continue
        ins = op.ins if isinstance(op, EagerMerge) else [op.input]
        shape = outs[0].type.shape
        for d, size in enumerate(shape):
            e = sp.sympify(size)
            if not isinstance(e, sp.Indexed) or str(e.base) in out:
                continue
            got = [of(v.type.shape[d]) for v in ins if len(v.type.shape) > d]
            if got and all(g is not None for g in got):
                out[str(e.base)] = max(got)  # type: ignore[type-var]
    return out
