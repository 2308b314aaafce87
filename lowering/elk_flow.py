"""On-chip activations between ELK operators (ELK §4.5 "execute"): an operator's output tiles
stay in the SRAM of the cores that produced them and the next operators' execute phases gather
their input tiles from those cores over the interconnect; HBM carries the preloads, the
inputs no earlier operator produced and the outputs no later operator reads (or that the caller
names as results).

Every activation region is seen in the 2-D view ``(dim0, product of the other dims)`` of its
tensor, so an attention output ``(B, H, D)`` read as a ``(B, H*D)`` matrix is still one
rectangle.  ``links`` name a consumer tensor whose 2-D view is the leading columns of a
producer tensor (a timing-only operator list gives every operator its own tensors).

Lowering runs twice: a recording pass collects every activation load and store of every core
(:meth:`Flow.get` / :meth:`Flow.put` fall back to HBM), then :meth:`Flow.plan` pairs each load
with the stored pieces it overlaps and the emitting pass sends / receives those pieces.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lowering.builder import CoreBuilder, ProgramBuilder, region

__all__ = ["Flow"]

Rect = tuple[int, int, int, int]  # row, col, rows, cols of a 2-D view


def _rect(shape: Sequence[int], st: Sequence[int] | None, ex: Sequence[int] | None) -> Rect | None:
    """The 2-D view of a region, or None when it is not one rectangle there."""
    if st is None or ex is None:
        st, ex = (0,) * len(shape), tuple(shape)
    if len(shape) == 1:
        return (0, st[0], 1, ex[0])
    inner = math.prod(shape[2:])
    if any(s != 0 or e != d for s, e, d in zip(st[2:], ex[2:], shape[2:])):
        return None
    return (st[0], st[1] * inner, ex[0], ex[1] * inner)


def _slice(key: tuple) -> dict[str, str]:
    """The ``elk_slice`` parameters of piece ``key`` (``(buffer, row, col, rows, cols, dtype)``
    relative to the buffer's region)."""
    return {"at": f"{key[1]},{key[2]}", "ext": f"{key[3]},{key[4]}"}


def _meet(a: Rect, b: Rect) -> Rect | None:
    r0, c0 = max(a[0], b[0]), max(a[1], b[1])
    r1, c1 = min(a[0] + a[2], b[0] + b[2]), min(a[1] + a[3], b[1] + b[3])
    return (r0, c0, r1 - r0, c1 - c0) if r1 > r0 and c1 > c0 else None


class _Overlaps:
    """The stored pieces of one tensor indexed by position: which of them a rectangle may
    overlap, found by bisection over row bands and, within a band, over column starts (a
    layer's pieces tile its tensors, so a load meets a few of them, not all)."""

    def __init__(self, puts: Sequence[_Put]) -> None:
        self.ops = {q.op for q in puts}
        bands: dict[tuple[int, int], list[int]] = {}
        for i, q in enumerate(puts):
            bands.setdefault((q.rect[0], q.rect[2]), []).append(i)
        self.rows = sorted(bands)
        self.row_starts = [b[0] for b in self.rows]
        self.tall = max((b[1] for b in self.rows), default=0)
        self.cols: list[tuple[list[int], list[int], int]] = []
        for key in self.rows:
            idx = sorted(bands[key], key=lambda i: puts[i].rect[1])
            starts = [puts[i].rect[1] for i in idx]
            wide = max(puts[i].rect[3] for i in idx)
            self.cols.append((starts, idx, wide))

    def candidates(self, rect: Rect) -> list[int]:
        """Indices (in store order) of every piece that can overlap ``rect``."""
        r0, c0, nr, nc = rect
        out: list[int] = []
        lo = bisect_left(self.row_starts, r0 - self.tall + 1)
        hi = bisect_left(self.row_starts, r0 + nr)
        for k in range(lo, hi):
            if self.rows[k][0] + self.rows[k][1] <= r0:
                continue
            starts, idx, wide = self.cols[k]
            out.extend(idx[bisect_left(starts, c0 - wide + 1) : bisect_left(starts, c0 + nc)])
        out.sort()
        return out


@dataclass
class _Put:
    op: int
    core: int
    buf: str
    rect: Rect
    dtype: str
    sends: list[tuple[str, Rect, int]] = field(default_factory=list)  # channel/keep, piece, dst


@dataclass
class Flow:
    """Which activation pieces travel core to core (see the module docstring)."""

    tensors: Mapping[str, tuple[tuple[int, ...], str]]
    links: Mapping[str, str] = field(default_factory=dict)
    results: Collection[str] = ()
    recording: bool = True
    _puts: dict[str, list[_Put]] = field(default_factory=dict)
    _gets: list[tuple[int, int, str, Rect | None]] = field(default_factory=list)
    _gathers: dict[tuple[int, int, str, Rect], list[list[tuple[str, Rect, int]]]] = field(
        default_factory=dict
    )
    _sends: dict[tuple[int, int, str], list[tuple[str, Rect, int]]] = field(default_factory=dict)
    _stored: set[str] = field(default_factory=set)
    held: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    #: every recorded store, in order (a layer's are copied to the equal layers after it)
    _putlog: list[tuple[str, _Put]] = field(default_factory=list)
    #: load index -> (index of the load it copies, its :class:`lowering.elk_layers.Renamer`)
    _copies: dict[int, tuple[int, Any]] = field(default_factory=dict)
    #: ``(producer op, consumer op, producer core, consumer core)`` -> the pieces' channel
    #: names in the order :meth:`plan` named them (:mod:`lowering.elk_layers` renames by it)
    names: dict[tuple[int, int, int, int], list[str]] = field(default_factory=dict)
    #: ``(tensor, starts, extents)`` -> its 2-D view (:func:`_rect`; the cores of a grid
    #: share their regions' shapes)
    _rects: dict[tuple, Rect | None] = field(default_factory=dict)
    #: the instructions cutting a piece out of a buffer to send it, by buffer, piece position
    #: and dtype: made once, appended as the same (shared) objects by every core cutting it
    _cuts: dict[tuple, tuple[list[Any], list[Any]]] = field(default_factory=dict)

    def _source(self, tensor: str) -> str:
        return self.links.get(tensor, tensor)

    def done(self) -> None:
        """After the programs are emitted: drop the records of loads, stores and sends.  What
        outlives the emission is :attr:`names` (the renamers of equal layers read it while the
        simulator compiles their copies); the records refer to those renamers, which refer to
        this flow, a cycle that would keep every record until a cyclic collection."""
        self._puts, self._gets, self._gathers, self._sends = {}, [], {}, {}
        self._putlog, self._copies, self._rects, self._cuts = [], {}, {}, {}
        self._stored, self.held = set(), {}

    def _view(self, tensor: str, st: Sequence[int] | None, ex: Sequence[int] | None) -> Rect | None:
        """:func:`_rect` of region ``(st, ex)`` of ``tensor``, kept by the region."""
        key = (tensor, st, ex)
        try:
            return self._rects[key]
        except KeyError:
            out = self._rects[key] = _rect(self.tensors[tensor][0], st, ex)
            return out
        except TypeError:  # starts or extents given as lists
            return _rect(self.tensors[tensor][0], st, ex)

    # -- the two calls the operator emitters make ----------------------------------------------
    def get(
        self,
        p: CoreBuilder,
        op: int,
        buf: str,
        tensor: str,
        st: Sequence[int] | None = None,
        ex: Sequence[int] | None = None,
    ) -> None:
        """Fill ``buf`` with region ``(st, ex)`` of ``tensor``: from the producing cores when
        every element was produced on chip, otherwise from HBM."""
        rect = self._view(tensor, st, ex)
        if self.recording:
            self._gets.append((op, p.core, tensor, rect))
        queue = None if rect is None else self._gathers.get((op, p.core, tensor, rect))
        pieces = queue.pop(0) if queue else None
        if not pieces:
            p.load(buf, tensor, None if st is None else region(st, ex))
            return
        shape = tuple(ex) if ex is not None else self.tensors[tensor][0]
        dtype = self.tensors[tensor][1]
        names = []
        for k, (chan, piece, src) in enumerate(pieces):
            if src == p.core:  # kept on this core since the producer ran
                names.append(chan)
                continue
            name = f"{buf}_g{k}"
            p.alloc(name, (piece[2], piece[3]), dtype)
            p.recv(chan, name)
            names.append(name)
        at = ";".join(f"{pc[0] - rect[0]},{pc[1] - rect[1]}" for _, pc, _ in pieces)
        p.compute("elk_place", buf, names, {"shape": ",".join(map(str, shape)), "at": at}, dtype)
        for name in names:
            p.free(name)

    def put(
        self,
        p: CoreBuilder,
        op: int,
        buf: str,
        tensor: str,
        st: Sequence[int] | None = None,
        ex: Sequence[int] | None = None,
    ) -> None:
        """``buf`` holds region ``(st, ex)`` of ``tensor``: send its pieces to the cores that
        read them (or keep them here), and store it to HBM when it is a result."""
        rect = self._view(tensor, st, ex)
        if self.recording:
            if rect is not None:
                put = _Put(op, p.core, buf, rect, self.tensors[tensor][1])
                self._puts.setdefault(tensor, []).append(put)
                self._putlog.append((tensor, put))
            p.store(buf, tensor, None if st is None else region(st, ex))
            return
        if tensor in self._stored or rect is None:
            p.store(buf, tensor, None if st is None else region(st, ex))
        dtype = self.tensors[tensor][1]
        # Pieces sharing a band of rows are cut from a copy of that band, so a tile re-cut for a
        # consumer with many small tiles reads the tile once per band, not once per piece.
        bands: dict[tuple[int, int], list[tuple[str, Rect, int]]] = {}
        for send in self._sends.get((op, p.core, buf), []):
            bands.setdefault((send[1][0], send[1][2]), []).append(send)
        for (r0, nr), group in bands.items():
            src, base = buf, rect
            if len(group) > 1 and nr < rect[2]:
                src, base = f"{buf}_band", (r0, rect[1], nr, rect[3])
                p.alloc(src, (nr, rect[3]), dtype)
                p.compute(
                    "elk_slice",
                    src,
                    buf,
                    {"at": f"{r0 - rect[0]},0", "ext": f"{nr},{rect[3]}"},
                    dtype,
                )
            # a piece several cores read (one activation block multiplied by many weight
            # blocks) is cut once and sent to each of them
            dests: dict[Rect, list[tuple[str, int]]] = {}
            for chan, piece, dst in group:
                dests.setdefault(piece, []).append((chan, dst))
            for piece, to in dests.items():
                self._emit_piece(p, piece, to, src, base, dtype)
            if src != buf:
                p.free(src)

    def _emit_piece(
        self,
        p: CoreBuilder,
        piece: Rect,
        to: Sequence[tuple[str, int]],
        src: str,
        base: Rect,
        dtype: str,
    ) -> None:
        """Keep ``piece`` of buffer ``src`` (holding region ``base``) on this core or send it:
        ``to`` lists its channels and their destination cores (this core: a local copy named
        by the channel); a piece that is not the whole buffer is cut once for every core
        it is sent to."""
        key = (src, piece[0] - base[0], piece[1] - base[1], piece[2], piece[3], dtype)
        remote = []
        for chan, dst in to:
            if dst == p.core:
                p.alloc(chan, (piece[2], piece[3]), dtype)
                p.compute("elk_slice", chan, src, _slice(key), dtype)
            else:
                remote.append(chan)
        if not remote:
            return
        if piece == base:
            for chan in remote:
                p.send(chan, src)
            return
        cut = f"{src}_cut"
        runs = self._cuts.get(key)
        if runs is None:
            k = p.size()
            p.alloc(cut, (piece[2], piece[3]), dtype)
            p.compute("elk_slice", cut, src, _slice(key), dtype)
            head = p.emitted(k)
            for chan in remote:
                p.send(chan, cut)
            k = p.size()
            p.free(cut)
            runs = (head, p.emitted(k))
            if runs[0] and runs[1]:  # a builder that keeps its instructions
                self._cuts[key] = runs
            return
        p.extend(runs[0])
        for chan in remote:
            p.send(chan, cut)
        p.extend(runs[1])

    # -- copies of an equal layer's records (lowering.elk_layers) ------------------------------
    def marks(self) -> tuple[int, int]:
        """Loads and stores recorded so far (where a section's records start)."""
        return len(self._gets), len(self._putlog)

    def copy_records(self, gets: range, puts: range, ren: Any) -> None:
        """Record the loads ``gets`` and stores ``puts`` (indices of earlier records) again for
        the operators ``ren.shift`` later, with ``ren``'s tensor and buffer names."""
        sh, out, copies = ren.shift, self._gets, self._copies
        for g in gets:
            op, core, tensor, rect = out[g]
            copies[len(out)] = (g, ren)
            out.append((op + sh, core, ren.tensor(tensor), rect))
        log, all_puts = self._putlog, self._puts
        for k in puts:
            tensor, q = log[k]
            put = _Put(q.op + sh, q.core, ren.name(q.buf), q.rect, q.dtype)
            all_puts.setdefault(ren.tensor(tensor), []).append(put)

    # -- between the two passes ----------------------------------------------------------------
    def plan(self, b: ProgramBuilder) -> None:
        """Pair the recorded loads with the stored pieces they overlap and declare a channel per
        piece; decide which tensors still reach HBM.  A load copied from an equal layer's
        (:meth:`copy_records`) meets the copies of the pieces that one met."""
        read_on_chip: set[str] = set()
        from_hbm: set[str] = set()
        index: dict[str, _Overlaps] = {}
        copies = self._copies
        wanted = {g for g, _ in copies.values()}
        outcome: dict[int, Any] = {}  # a copied load's: None (HBM), or its pieces
        for g, (op, core, tensor, rect) in enumerate(self._gets):
            src = self._source(tensor)
            copy = copies.get(g) if copies else None
            if copy is not None:
                if copy[0] in outcome:  # else no operator stored its tensor: HBM
                    self._copy_pieces(b, op, core, outcome[copy[0]], copy[1])
                    (from_hbm if outcome[copy[0]] is None else read_on_chip).add(src)
                continue
            puts = self._puts.get(src)
            if not puts:
                continue
            where = index.get(src)
            if where is None:
                where = index[src] = _Overlaps(puts)
            if rect is None or len(where.ops) != 1 or puts[0].op >= op:
                from_hbm.add(src)
                if g in wanted:
                    outcome[g] = None
                continue
            found = [
                (puts[i], m)
                for i in where.candidates(rect)
                if (m := _meet(puts[i].rect, rect)) is not None
            ]
            if sum(m[2] * m[3] for _, m in found) != rect[2] * rect[3]:
                from_hbm.add(src)  # not every element was produced on chip
                if g in wanted:
                    outcome[g] = None
                continue
            read_on_chip.add(src)
            if g in wanted:
                outcome[g] = [(q.op, q.core, q.buf, m) for q, m in found]
            pieces = []
            for q, m in found:
                name = self._piece(b, q.op, op, q.core, core, q.buf, m)
                pieces.append((name, m, q.core))
            self._gathers.setdefault((op, core, tensor, rect), []).append(pieces)
        self._stored = {
            t for t in self._puts if t not in read_on_chip or t in self.results or t in from_hbm
        }
        self.recording = False

    def _piece(
        self, b: ProgramBuilder, qop: int, op: int, qcore: int, core: int, buf: str, m: Rect
    ) -> str:
        """Name (and declare the channel of) a piece of ``qop``'s output stored from ``buf`` on
        ``qcore`` that ``op`` reads on ``core``."""
        held = self.held.setdefault(qcore, [])
        name = f"a{qop}_{op}_{qcore}_{core}_{len(held)}"
        if qcore != core:
            b.channel(name, qcore, core, depth=1)
        self._sends.setdefault((qop, qcore, buf), []).append((name, m, core))
        held.append((qop, op, m[2] * m[3]))
        self.names.setdefault((qop, op, qcore, core), []).append(name)
        return name

    def _copy_pieces(self, b: ProgramBuilder, op: int, core: int, found: Any, ren: Any) -> None:
        """The pieces of a copied load: those of the load it copies, ``ren.shift`` operators on
        (``found`` ``None``: that one read HBM)."""
        if found is None:
            return
        sh = ren.shift
        for qop, qcore, buf, m in found:
            self._piece(b, qop + sh, op, qcore, core, ren.name(buf), m)
