"""Row rules: a unit step's cost as a function of the rows its input tile holds at run time.

A tile whose declared row count is dynamic (``Tile[moe_n0, 32]``: the tokens an expert got; a
KV tile's rows) reaches a unit with a size only the run knows.  STeP times a unit step by the
FLOPs of the element's actual shapes (STeP §4.2), so the ``step_unit`` Compute of such a step
carries a :class:`~.timing.RowRule`: its cycles (the roofline of
:meth:`~.timing.TimingModel.roofline`, term by term) and its output sizes as ``a*rows + c`` of
the rows of the tile it receives, and the simulator prices the tile it actually gets.

:func:`row_rule` derives the rule by evaluating the tile function's FLOP count at the element's
own row count and at others (the tile function's ``flops_of`` on concrete types); it keeps the
literal cycles (returns ``None``) when the count is not linear in the rows, when the element's
dynamic tiles disagree on their rows, or when a dynamic dimension is not the rows.  At the
run's own shapes the rule gives exactly the literal's cycles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch2step.step.types import DTYPE_BYTES, DataType, TileType, TupleType

from .timing import RowRule, TimingModel, UnitConfig

__all__ = ["row_rule", "with_rows"]

#: Row counts besides the run's at which a FLOP count is checked to be linear in the rows.
_PROBES = (1, 2, 5)


def _leaves(x: Any, t: DataType, at: list[int]) -> Iterator[tuple[int, TileType, tuple]]:
    """``(part index, declared tile, actual shape)`` of the tile leaves of element ``x``."""
    if isinstance(t, TupleType):
        for v, s in zip(x, t.elems):
            yield from _leaves(v, s, at)
        return
    if isinstance(t, TileType) and hasattr(x, "shape"):
        yield at[0], t, (int(x.shape[0]), int(x.shape[1]))
    at[0] += 1  # every non-tuple leaf is one part (streams.element_parts)


def _dynamic(t: TileType) -> tuple[bool, bool]:
    rows, cols = t.shape
    return (not rows.is_Integer, not cols.is_Integer)


def _scan(x: Any, t: DataType, rows: int | None) -> tuple[int | None, list] | None:
    """The rows shared by the dynamic tiles of ``x`` (``rows`` if given) and their leaves;
    ``None`` when a dynamic dimension is not the rows or the dynamic tiles disagree."""
    leaves = list(_leaves(x, t, [0]))
    for _, decl, shape in leaves:
        dr, dc = _dynamic(decl)
        if dc:
            return None
        if dr:
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                return None
    return rows, leaves


def with_rows(x: Any, t: DataType, rows: int) -> DataType:
    """The declared type ``t`` with ``x``'s actual shapes, dynamic rows set to ``rows``."""
    if isinstance(t, TupleType):
        return TupleType(tuple(with_rows(v, s, rows) for v, s in zip(x, t.elems)))
    if isinstance(t, TileType) and hasattr(x, "shape"):
        r = rows if _dynamic(t)[0] else int(x.shape[0])
        return TileType((r, int(x.shape[1])), t.dtype)
    return t


def _bytes(leaves: list, rows: int, parts: tuple) -> tuple[int, int]:
    """``(a, c)``: data bytes of ``parts`` as ``a*rows + c``."""
    a = c = 0
    for i, decl, shape in leaves:
        p = parts[i]
        if p.kind != "data":
            continue
        if _dynamic(decl)[0]:
            a += shape[1] * DTYPE_BYTES[p.dtype]
        else:
            c += p.nbytes
    return a, c


def row_rule(
    timing: TimingModel,
    cfg: UnitConfig,
    rate: int,
    flops: Callable[[int], int],
    src: tuple[Any, DataType, tuple],
    out: tuple[Any, DataType, tuple],
    out_bytes: bool = True,
    state: tuple[Any, DataType] | None = None,
) -> RowRule | None:
    """The row rule of a step on element ``src = (value, declared type, parts)`` producing
    ``out = (value, declared type, parts)`` (``out_bytes``: whether the output bytes are timed),
    ``flops(rows)`` its FLOP count with the dynamic rows set to ``rows``; ``state``: an
    accumulator's ``(value, declared type)``, whose dynamic rows must be the element's."""
    x, t, in_parts = src
    found = _scan(x, t, None)
    if found is None or found[0] is None:
        return None
    rows, leaves = found
    slot, cols = next((i, shape[1]) for i, decl, shape in leaves if _dynamic(decl)[0])
    if in_parts[slot].kind != "data" or cols == 0:
        return None
    if state is not None and _scan(*state, rows) is None:
        return None
    o = _scan(out[0], out[1], rows)
    if o is None:
        return None
    out_leaves = o[1]
    f0 = flops(rows)
    f1 = flops(rows + 1)
    a = f1 - f0
    if any(flops(rows + d) != f0 + a * d for d in _PROBES[1:]):
        return None
    terms = []
    if f0 or a:
        terms.append((a, f0 - a * rows, rate))
    if cfg.reads_memory:
        ia, ic = _bytes(leaves, rows, in_parts)
        terms.append((ia, ic, timing.mem_bw))
    if cfg.writes_memory and out_bytes:
        oa, oc = _bytes(out_leaves, rows, out[2])
        terms.append((oa, oc, timing.mem_bw))
    outs = []
    for i, decl, shape in out_leaves:
        if out[2][i].kind != "data":
            continue
        outs.append((shape[1], 0) if _dynamic(decl)[0] else (0, out[2][i].elems))
    return RowRule(slot, cols, tuple(terms), tuple(outs))
