"""The reduce-scatter of a matrix product's partial sums down a grid column (ELK §2.2: "these
cores will exchange the partial results via the interconnect"), after which every core holds
one slice of its column's result for the next operator to gather (:mod:`lowering.elk_flow`).
Its cost model is :func:`elk.cost._matmul`; :mod:`lowering.elk_programs` emits the rest of the
product."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lowering.builder import CoreBuilder, ProgramBuilder
from lowering.elk_flow import Flow
from lowering.elk_placement import Placed
from lowering.errors import ProgramError
from lowering.isa import Instr

__all__ = ["halving_steps", "scatter"]


def halving_steps(tk: int, r: int) -> list[tuple[tuple[int, int], int, tuple[int, int]]]:
    """The recursive-halving reduce-scatter of core ``r`` of a grid column of ``tk`` cores
    (``tk`` a power of two): per step ``(sent slices, partner, kept slices)``, slice ranges
    ``[lo, hi)``.  Step ``i`` halves the kept range: the half without ``r`` goes to the partner
    ``r ^ tk / 2^(i+1)`` (which keeps it), the partner's copy of the other half comes back and is
    added; after ``log2 tk`` steps core ``r`` holds slice ``r``."""
    if tk & (tk - 1) or not 0 <= r < tk:
        raise ProgramError(f"halving_steps: {tk} cores is not a power of two (core {r})")
    lo, hi, d, out = 0, tk, tk // 2, []
    while d >= 1:
        mid = lo + d
        if r < mid:
            out.append(((mid, hi), r + d, (lo, mid)))
            hi = mid
        else:
            out.append(((lo, mid), r - d, (mid, hi)))
            lo = mid
        d //= 2
    return out


def scatter(
    b: ProgramBuilder,
    p: CoreBuilder,
    j: int,
    pl: Placed,
    r: int,
    c: int,
    dt: str,
    flow: Flow,
    axis: int,
    order: Sequence[int],
    memo: dict[tuple, Any] | None = None,
) -> bool:
    """The product of core ``(r, c)`` combined by a reduce-scatter down grid column ``c``
    (:func:`elk.cost._matmul`), after which the core holds slice ``r`` (along ``axis``) of the
    column's result.  A power-of-two column halves recursively (:func:`halving_steps`): the
    product is written straight into the pieces the steps send plus slice ``r``, and each
    received half is added into the pieces of the kept half by one ``add_parts``, so a core sends
    ``log2 tk`` messages.  Otherwise the reduce-scatter is direct: in step ``s`` the core sends
    slice ``r + s`` to that core and adds the slice core ``r - s`` sent.

    Every core of grid row ``r`` runs the same instructions apart from its channels and the
    pieces it passes on (:meth:`Flow.put`): ``memo`` (one per program builder) keeps those of
    the row's first core (:class:`_Row`), and the row's other cores append the same objects
    (the builder's shared instructions, :class:`lowering.builder.ProgramBuilder`
    ``share=True``) rather than building each again."""
    m, _, n = pl.op.dims
    tk = pl.rows
    nb = n // pl.cols
    ext = (m // tk, nb) if axis == 0 else (m, nb // tk)
    key = ("scatter", j, r, axis, tuple(order))
    row = None if memo is None else memo.get(key)
    if row is None:
        row = _Row(j, pl, r, axis, ext)
        if memo is not None:
            memo[key] = row
    row.emit(p, 0, _head, p, j, row, order, dt)
    for i, (lo, partner, t, size, kept) in enumerate(row.steps):
        out, back = f"o{j}_h{r}_{partner}_{c}", f"o{j}_h{partner}_{r}_{c}"
        if not b.has_channel(out):
            b.channel(out, pl.core(r, c), pl.core(partner, c))
        if not b.has_channel(back):
            b.channel(back, pl.core(partner, c), pl.core(r, c))
        p.send(out, lo)
        row.emit(p, 2 * i + 1, p.alloc, t, size, dt)
        p.recv(back, t)
        row.emit(p, 2 * i + 2, _add, p, t, kept, axis, dt)
    mine = row.mine
    if not row.steps and tk > 1:
        for s in range(1, tk):
            dst = (r + s) % tk
            ch = f"o{j}_x{r}_{dst}_{c}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r, c), pl.core(dst, c))
            p.send(ch, row.parts[dst])
        tmps = [f"o{j}_t{u}" for u in range(min(2, tk - 1))]
        for buf in tmps:
            p.alloc(buf, ext, dt)
        for s in range(1, tk):
            src = (r - s) % tk
            ch = f"o{j}_x{src}_{r}_{c}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(src, c), pl.core(r, c))
            t = tmps[s % len(tmps)]
            p.recv(ch, t)
            p.compute("add", mine, (mine, t), dtype=dt)
        for buf in tmps:
            p.free(buf)
    if axis == 0:
        at = (r * ext[0], c * nb)
    else:
        at = (0, c * nb + r * ext[1])
    flow.put(p, j, mine, pl.op.tensor("y"), at, ext)
    row.emit(p, -1, _frees, p, row.parts)
    return True


class _Row:
    """The reduce-scatter of grid row ``r`` of product ``j`` apart from its channels: the
    partial-sum buffers (``parts``; ``mine``: the one the core keeps), the halving steps
    (``(piece sent, partner, temporary, its extent, pieces added to)``), and the runs of
    channel-free instructions the row's first core emitted (:meth:`emit`)."""

    __slots__ = ("parts", "mine", "ranges", "params", "steps", "runs")

    def __init__(self, j: int, pl: Placed, r: int, axis: int, ext: tuple[int, int]) -> None:
        m, _, n = pl.op.dims
        tk = pl.rows
        nb = n // pl.cols

        def extent(slices: int) -> tuple[int, int]:
            return (ext[0] * slices, nb) if axis == 0 else (m, ext[1] * slices)

        self.steps: list[tuple[str, int, str, tuple[int, int], list[str]]] = []
        self.runs: dict[int, list[Instr]] = {}
        self.params: dict[str, int | str]
        if tk & (tk - 1) == 0:
            halving = halving_steps(tk, r)
            ranges = sorted([sent for sent, _, _ in halving] + [(r, r + 1)])
            self.parts = [f"o{j}_p{lo}" for lo, _ in ranges]
            self.ranges = [(buf, extent(hi - lo)) for (lo, hi), buf in zip(ranges, self.parts)]
            self.params = {"sizes": ",".join(str(hi - lo) for lo, hi in ranges), "axis": axis}
            self.mine = f"o{j}_p{r}"
            for i, ((lo, _), partner, (klo, khi)) in enumerate(halving):
                kept = [f"o{j}_p{a}" for a, _ in ranges if klo <= a < khi]
                self.steps.append((f"o{j}_p{lo}", partner, f"o{j}_t{i}", extent(khi - klo), kept))
        else:
            self.parts = [f"o{j}_p{s}" for s in range(tk)]
            self.ranges = [(buf, ext) for buf in self.parts]
            self.params = {"parts": tk, "axis": axis}
            self.mine = self.parts[r]

    def emit(self, p: CoreBuilder, at: int, make: Callable[..., object], *args: Any) -> None:
        """Run ``at`` of the row: appended as the first core made it, or made by
        ``make(*args)`` on ``p``."""
        run = self.runs.get(at)
        if run is None:
            start = p.size()
            make(*args)
            self.runs[at] = p.emitted(start)
        else:
            p.extend(run)


def _head(p: CoreBuilder, j: int, row: _Row, order: Sequence[int], dt: str) -> None:
    """The partial-sum buffers and the products into them, weight piece by weight piece."""
    parts = row.parts
    for buf, ext in row.ranges:
        p.alloc(buf, ext, dt)
    for q in order:
        a, w = f"o{j}_a{q}", f"o{j}_w{q}"
        p.compute("mm_parts", parts, (a, w) if q == order[0] else (a, w, *parts), row.params, dt)
        p.free(a)
        p.free(w)


def _add(p: CoreBuilder, t: str, kept: list[str], axis: int, dt: str) -> None:
    p.compute("add_parts", kept, (t, *kept), {"axis": axis}, dt)
    p.free(t)


def _frees(p: CoreBuilder, parts: list[str]) -> None:
    for buf in parts:
        p.free(buf)
