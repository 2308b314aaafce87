"""A core's body whose copied layer sections are kept as references (ELK §4.4: equal layers).

:mod:`lowering.elk_layers` emits the sections of layer 2 and later that equal layer 1's once:
a copy is layer 1's range of the same core with every name shifted.  :class:`LayeredBody`
holds the instructions the core emitted itself and, for each copy, where it sits, which range
it copies and by how many operators its names move.  A simulator that compiles a copy from its
template (:mod:`runtime.program_layers`, reading :attr:`CopiedProgramSet.copies`) never reads
the copied instructions, so building a step of ``N`` layers costs the emitted layers plus
bookkeeping per copy.  Any other reader gets the renamed instructions, made on first use (and
kept, shared between the cores whose template instructions are the same object): the body is
equal, instruction by instruction, to the tuple the full emission builds (same ``len``,
``==``, ``hash`` and ``repr``; pickled as that tuple).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any, overload

from lowering.isa import Instr

__all__ = ["LayeredBody"]

#: ``copy(shift, instructions)``: the instructions with their names ``shift`` operators on
Copier = Callable[[int, Sequence[Instr]], list[Instr]]


class LayeredBody(Sequence[Instr]):
    """The instructions of one core: ``real`` (those emitted) with copied ranges inserted.

    ``copies``: ``(position in real, length, template start, shift)`` in body order, the
    template start being a position of the body before any copy (a template precedes every
    copy of it on its core, so it is also a position in ``real``)."""

    __slots__ = ("_real", "_starts", "_segs", "_len", "_copy")

    def __init__(
        self,
        real: Sequence[Instr],
        copies: Sequence[tuple[int, int, int, int]],
        copy: Copier,
    ) -> None:
        self._real = tuple(real)
        self._copy = copy
        #: (body start, body stop, real start or -1, template start, shift)
        segs: list[tuple[int, int, int, int, int]] = []
        at = 0  # position in real
        pos = 0  # position in the body
        for rp, n, ts, d in copies:
            if rp < at or ts + n > rp:
                raise ValueError(f"copied range at {rp} (of {ts}..{ts + n}) out of order")
            if rp > at:
                segs.append((pos, pos + rp - at, at, 0, 0))
                pos += rp - at
                at = rp
            segs.append((pos, pos + n, -1, ts, d))
            pos += n
        if at < len(self._real):
            segs.append((pos, pos + len(self._real) - at, at, 0, 0))
            pos += len(self._real) - at
        self._segs = segs
        self._starts = [s[0] for s in segs]
        self._len = pos

    def __len__(self) -> int:
        return self._len

    def _part(self, seg: tuple[int, int, int, int, int], lo: int, hi: int) -> Sequence[Instr]:
        """Body positions ``lo .. hi-1`` of segment ``seg``."""
        start, _, rs, ts, d = seg
        if rs >= 0:
            return self._real[rs + lo - start : rs + hi - start]
        return self._copy(d, self._real[ts + lo - start : ts + hi - start])

    def __iter__(self) -> Iterator[Instr]:
        for seg in self._segs:
            yield from self._part(seg, seg[0], seg[1])

    @overload
    def __getitem__(self, i: int) -> Instr: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Instr, ...]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self._len)
            if step != 1:
                return tuple(self)[i]
            out: list[Instr] = []
            k = max(0, bisect_right(self._starts, lo) - 1)
            for seg in islice(self._segs, k, None):
                if seg[0] >= hi:
                    break
                a, b = max(lo, seg[0]), min(hi, seg[1])
                if a < b:
                    out.extend(self._part(seg, a, b))
            return tuple(out)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("body index out of range")
        seg = self._segs[bisect_right(self._starts, i) - 1]
        return self._part(seg, i, i + 1)[0]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LayeredBody | tuple):
            return len(other) == self._len and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))
