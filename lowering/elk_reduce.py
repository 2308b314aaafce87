"""The reduce-scatter of a matrix product's partial sums down a grid column (ELK §2.2: "these
cores will exchange the partial results via the interconnect"), after which every core holds
one slice of its column's result for the next operator to gather (:mod:`lowering.elk_flow`).
Its cost model is :func:`elk.cost._matmul`; :mod:`lowering.elk_programs` emits the rest of the
product."""

from __future__ import annotations

from collections.abc import Sequence

from lowering.builder import CoreBuilder, ProgramBuilder
from lowering.elk_flow import Flow
from lowering.elk_placement import Placed
from lowering.errors import ProgramError

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
) -> bool:
    """The product of core ``(r, c)`` combined by a reduce-scatter down grid column ``c``
    (:func:`elk.cost._matmul`), after which the core holds slice ``r`` (along ``axis``) of the
    column's result.  A power-of-two column halves recursively (:func:`halving_steps`): the
    product is written straight into the pieces the steps send plus slice ``r``, and each
    received half is added into the pieces of the kept half by one ``add_parts``, so a core sends
    ``log2 tk`` messages.  Otherwise the reduce-scatter is direct: in step ``s`` the core sends
    slice ``r + s`` to that core and adds the slice core ``r - s`` sent."""
    m, _, n = pl.op.dims
    tk = pl.rows
    nb = n // pl.cols
    ext = (m // tk, nb) if axis == 0 else (m, nb // tk)

    def extent(slices: int) -> tuple[int, int]:
        return (ext[0] * slices, nb) if axis == 0 else (m, ext[1] * slices)

    if tk & (tk - 1) == 0:
        steps = halving_steps(tk, r)
        ranges = sorted([sent for sent, _, _ in steps] + [(r, r + 1)])
        parts = [f"o{j}_p{lo}" for lo, _ in ranges]
        for (lo, hi), buf in zip(ranges, parts):
            p.alloc(buf, extent(hi - lo), dt)
        params: dict[str, int | str] = {
            "sizes": ",".join(str(hi - lo) for lo, hi in ranges),
            "axis": axis,
        }
    else:
        steps, ranges = [], []
        parts = [f"o{j}_p{s}" for s in range(tk)]
        for buf in parts:
            p.alloc(buf, ext, dt)
        params = {"parts": tk, "axis": axis}
    for q in order:
        a, w = f"o{j}_a{q}", f"o{j}_w{q}"
        p.compute("mm_parts", parts, (a, w) if q == order[0] else (a, w, *parts), params, dt)
        p.free(a)
        p.free(w)
    mine = parts[r] if not steps else f"o{j}_p{r}"
    for i, ((lo, _), partner, (klo, khi)) in enumerate(steps):
        out, back = f"o{j}_h{r}_{partner}_{c}", f"o{j}_h{partner}_{r}_{c}"
        if not b.has_channel(out):
            b.channel(out, pl.core(r, c), pl.core(partner, c))
        if not b.has_channel(back):
            b.channel(back, pl.core(partner, c), pl.core(r, c))
        p.send(out, f"o{j}_p{lo}")
        t = f"o{j}_t{i}"
        p.alloc(t, extent(khi - klo), dt)
        p.recv(back, t)
        kept = [f"o{j}_p{a}" for a, _ in ranges if klo <= a < khi]
        p.compute("add_parts", kept, (t, *kept), {"axis": axis}, dt)
        p.free(t)
    if not steps and tk > 1:
        for s in range(1, tk):
            dst = (r + s) % tk
            ch = f"o{j}_x{r}_{dst}_{c}"
            if not b.has_channel(ch):
                b.channel(ch, pl.core(r, c), pl.core(dst, c))
            p.send(ch, parts[dst])
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
    for buf in parts:
        p.free(buf)
    return True
