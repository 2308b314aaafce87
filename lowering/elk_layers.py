"""Equal layers of a stacked ELK program emitted once and copied (ELK §4.4: the decoder layers
of a step are the same operators, planned with the same preload order and issue points).

The per-core programs of :mod:`lowering.elk_programs` are cut into sections: section ``i`` of
core ``c`` is what ``c`` emits between ``go_i`` and ``go_{i+1}`` (the token, the preloads
issued in section ``i``, its tile of operator ``i``, the ``done`` token; ELK §4.5), with the
channels declared there and the activation loads and stores :class:`lowering.elk_flow.Flow`
records there.  Two sections ``i`` and ``i + s`` (``s`` a multiple of the layer size) are
*equal* when every operator the section touches — operator ``i``, the operators it preloads
and the operators sharing an activation tensor with it — is, ``s`` operators on, the same
operator (kind, shape, dtype, tensor roles and shapes with layer-relative names, plan tiles,
placed cores), the preload lists match position by position and neither or both are the last
section.  A section of layer 2 or later equal to its counterpart in layer 1 is not emitted:
layer 1's section is recorded once and copied with every name shifted (:class:`Renamer`),
so the program set is exactly the one the full emission builds.  The copied instructions are
renamed only when read (:class:`lowering.elk_copies.LayeredBody`): a simulator runs a copy from
its template's compiled operations with the copy's names bound (:mod:`runtime.program_layers`),
so a step of ``N`` layers is built at the cost of the emitted layers plus, per copy, its
channels, its activation records and one mark per core.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elk.ops import Operator
from lowering.builder import CoreBuilder, ProgramBuilder, RecordingBuilder
from lowering.elk_copies import LayeredBody
from lowering.elk_flow import Flow
from lowering.elk_placement import Placed
from lowering.errors import ProgramError
from lowering.isa import (
    Alloc,
    Compute,
    Free,
    Instr,
    Load,
    Program,
    ProgramSet,
    Recv,
    RecvValue,
    Send,
    SendValue,
    Store,
)

__all__ = ["CopiedProgramSet", "Layering", "Renamer", "find_layering"]

#: a stacked tensor name: layer ``l``'s tensors are ``L<l>.<name>``
_LAYER = re.compile(r"L(\d+)\.(.*)", re.S)


class Renamer:
    """Names ``shift`` operators (``layers`` layers) on: ``L<l>.`` tensors to ``L<l+layers>.``,
    buffers and channels ``o<j>_*`` to ``o<j+shift>_*``, ``go<i>`` / ``done<i>_<c>`` tokens to
    ``i + shift``, activation pieces ``a<q>_<j>_<qc>_<c>_<k>`` to the piece of the same
    position between the shifted operators (:attr:`Flow.names`, whose counter ``k`` is
    global)."""

    def __init__(
        self,
        shift: int,
        layers: int,
        flow: Flow,
        parsed: dict[str, tuple[str, Any, str]] | None = None,
    ) -> None:
        self.shift = shift
        #: names taken apart (:func:`_parse`), shared by the renamers of one program set
        self.parsed = {} if parsed is None else parsed
        self.layers = layers
        self.flow = flow
        #: every name renamed so far; a missing one is renamed on lookup (``KeyError`` when it
        #: cannot be: :func:`runtime.program_layers.compile_layered` then compiles the copy)
        self._names: dict[str, str] = _Names(self._rename)
        self._tensors: dict[str, str] = _Names(self._tensor)
        #: id of a template instruction -> its renamed instruction (:meth:`copy`)
        self._made: dict[int, Instr] = {}

    def tensor(self, name: str) -> str:
        out = self._tensors.get(name)
        if out is None:
            out = self._tensors[name] = self._tensor(name)
        return out

    def _tensor(self, name: str) -> str:
        m = _LAYER.fullmatch(name)
        return f"L{int(m[1]) + self.layers}.{m[2]}" if m else name

    def name(self, name: str) -> str:
        out = self._names.get(name)
        if out is None:
            out = self._names[name] = self._rename(name)
        return out

    def _rename(self, name: str) -> str:
        sh = self.shift
        kind, i, rest = _parse(name, self.parsed)
        if kind == "a":
            names = self.flow.names
            q, j, qc, c = i
            try:
                return names[(q + sh, j + sh, qc, c)][names[i].index(name)]
            except (KeyError, IndexError, ValueError):
                raise ProgramError(f"no piece {sh} operators on from {name!r}") from None
        return f"{kind}{i + sh}{rest}"

    def instr(self, x: Instr) -> Instr:
        """``x`` with its names shifted."""
        fn = _RENAME.get(x.__class__)
        if fn is None:
            raise ProgramError(f"cannot copy a {x.__class__.__name__} to another layer")
        return fn(self, x)

    def copy(self, instrs: Sequence[Instr]) -> list[Instr]:
        """``instrs`` renamed, each template instruction object renamed once (a program
        builder shares equal instructions between cores, and so do their copies)."""
        made, out = self._made, []
        for x in instrs:
            y = made.get(id(x))
            if y is None:
                y = made[id(x)] = self.instr(x)
            out.append(y)
        return out


class _Names(dict):
    """A dict of renamed names that renames a missing one on lookup (``KeyError``: it cannot
    be renamed)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[str], str]) -> None:
        super().__init__()
        # weakly: ``make`` is a method of the renamer that holds this dict, so a strong
        # reference would be a cycle keeping the renamer (and the layers' activation flow)
        # alive until a cyclic collection after the program set is dropped
        self._make = weakref.WeakMethod(make)  # type: ignore[arg-type]

    def __missing__(self, name: str) -> str:
        make = self._make()
        assert make is not None, "a renamer's names outlived it"
        try:
            out = self[name] = make(name)
        except ProgramError:
            raise KeyError(name) from None
        return out


def _parse(name: str, cache: dict[str, tuple[str, Any, str]]) -> tuple[str, Any, str]:
    """``name`` as ``(head, number to shift, tail)`` (pieces: ``("a", key, "")``), the number
    :class:`Renamer` shifts and what surrounds it (kept in ``cache``)."""
    out = cache.get(name)
    if out is not None:
        return out
    try:
        if name[:1] == "o":
            j, rest = name[1:].split("_", 1)
            out = ("o", int(j), "_" + rest)
        elif name[:1] == "a":
            q, j, qc, c, _ = (int(x) for x in name[1:].split("_"))
            out = ("a", (q, j, qc, c), "")
        elif name.startswith("go"):
            out = ("go", int(name[2:]), "")
        elif name.startswith("done"):
            i, c = name[4:].split("_")
            out = ("done", int(i), "_" + str(int(c)))
    except ValueError:
        out = None
    if out is None:
        raise ProgramError(f"cannot shift {name!r}: not a name of an ELK program")
    cache[name] = out
    return out


def _maker(cls: type) -> Callable[..., Any]:
    """A constructor of the frozen instruction class ``cls`` that stores each field through its
    slot (the dataclass ``__init__`` goes through ``object.__setattr__`` per field)."""
    fields = [f.name for f in dataclasses.fields(cls)]
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    scope.update({f"s_{f}": getattr(cls, f).__set__ for f in fields})
    body = "".join(f"    s_{f}(o, {f})\n" for f in fields)
    exec(f"def make({', '.join(fields)}):\n    o = new(cls)\n{body}    return o\n", scope)  # noqa: S102
    return scope["make"]


_MK = {
    cls: _maker(cls)
    for cls in (Alloc, Free, Compute, Load, Store, Send, Recv, SendValue, RecvValue)
}


def _n(r: Renamer, name: str) -> str:
    return r._names.get(name) or r.name(name)


def _alloc(r: Renamer, x: Alloc) -> Instr:
    return _MK[Alloc](_n(r, x.buf), x.shape, x.dtype, x.held)


def _free(r: Renamer, x: Free) -> Instr:
    return _MK[Free](_n(r, x.buf))


def _compute(r: Renamer, x: Compute) -> Instr:
    outs = tuple([_n(r, b) for b in x.outs])
    return _MK[Compute](x.kernel, outs, tuple([_n(r, b) for b in x.ins]), x.params, x.dtype)


def _load(r: Renamer, x: Load) -> Instr:
    return _MK[Load](_n(r, x.dst), r.tensor(x.tensor), x.region, x.background)


def _store(r: Renamer, x: Store) -> Instr:
    return _MK[Store](_n(r, x.src), r.tensor(x.tensor), x.region, x.accumulate)


def _send(r: Renamer, x: Send) -> Instr:
    return _MK[Send](_n(r, x.channel), _n(r, x.src))


def _recv(r: Renamer, x: Recv) -> Instr:
    return _MK[Recv](_n(r, x.channel), _n(r, x.dst), x.stop)


def _send_value(r: Renamer, x: SendValue) -> Instr:
    return _MK[SendValue](_n(r, x.channel), x.value, x.stop)


def _recv_value(r: Renamer, x: RecvValue) -> Instr:
    return _MK[RecvValue](_n(r, x.channel), x.reg, x.stop)


_RENAME: dict[type, Callable[[Renamer, Any], Instr]] = {
    Alloc: _alloc,
    Free: _free,
    Compute: _compute,
    Load: _load,
    Store: _store,
    Send: _send,
    Recv: _recv,
    SendValue: _send_value,
    RecvValue: _recv_value,
}


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One core's emitted template section: where its instructions are in the core's body
    (``start``, ``length``), the channels it declared, whether it reported to the
    controller."""

    start: int
    length: int
    chans: tuple[str, ...]
    fin: bool


class Layering:
    """Which sections are copies (``source[i]``: the section copied, ``-1``: emitted) and the
    records of the copied ones, per pass (see the module docstring).  A copy's instructions
    are not built: the body keeps where it sits and what it copies
    (:class:`lowering.elk_copies.LayeredBody`), so a copy costs its channels and records, not
    its instructions."""

    def __init__(self, size: int, source: list[int], flow: Flow) -> None:
        self.size = size  # operators per layer
        self.source = source
        self.template = [False] * len(source)
        shifts: set[int] = set()
        for i, s in enumerate(source):
            if s >= 0:
                self.template[s] = True
                shifts.add(i - s)
        self.flow = flow
        parsed: dict[str, tuple[str, Any, str]] = {}
        self._renamers = {d: Renamer(d, d // size, flow, parsed) for d in sorted(shifts)}
        self._records: dict[tuple[int, int], tuple[range, range]] = {}
        self._chunks: dict[tuple[int, int], _Chunk] = {}
        #: core -> [(start, length, template start, shift)]: the body ranges that are copies
        self._copied: dict[int, list[tuple[int, int, int, int]]] = {}
        #: core -> the same with the start counted in the emitted instructions only
        self._at: dict[int, list[tuple[int, int, int, int]]] = {}
        #: core -> instructions in its copies so far
        self._offset: dict[int, int] = {}

    def held(self, b: ProgramBuilder) -> Collection[tuple[int, int]]:
        """The ``(core, section)`` template sections that hold something to copy in the pass
        of ``b`` (a copy of any other is empty)."""
        return self._records if isinstance(b, RecordingBuilder) else self._chunks

    @property
    def copies(self) -> int:
        """Sections copied rather than emitted."""
        return sum(1 for s in self.source if s >= 0)

    def mark(self, b: ProgramBuilder, p: CoreBuilder) -> tuple[int, int, int, int]:
        """Where a template section starts: instructions, channels, loads and stores so far."""
        return (p.size(), b.channel_count(), *self.flow.marks())

    def capture(
        self,
        b: ProgramBuilder,
        p: CoreBuilder,
        i: int,
        mark: tuple[int, int, int, int],
        fin: bool,
    ) -> None:
        """Keep what core ``p.core`` emitted in template section ``i`` since ``mark``."""
        key = (p.core, i)
        if isinstance(b, RecordingBuilder):
            g, q = self.flow.marks()
            if g > mark[2] or q > mark[3]:
                self._records[key] = (range(mark[2], g), range(mark[3], q))
            return
        if self._offset.get(p.core):
            raise ProgramError(f"core {p.core}: template section {i} follows a copy")
        instrs = p.emitted(mark[0])
        for cls in {x.__class__ for x in instrs}:
            if cls not in _RENAME:
                raise ProgramError(f"cannot copy a {cls.__name__} to another layer")
        chans = tuple(b.channels_since(mark[1]))
        if instrs or chans or fin:
            self._chunks[key] = _Chunk(mark[0], len(instrs), chans, fin)

    def replay(self, b: ProgramBuilder, p: CoreBuilder, i: int, finishers: list[list[int]]) -> None:
        """Core ``p.core``'s section ``i``: its template section's records, renamed."""
        src = self.source[i]
        key = (p.core, src)
        ren = self._renamers[i - src]
        if isinstance(b, RecordingBuilder):
            rec = self._records.get(key)
            if rec is not None:
                self.flow.copy_records(rec[0], rec[1], ren)
            return
        chunk = self._chunks.get(key)
        if chunk is None:
            return
        for name in chunk.chans:
            ch = b.declared(name)
            b.channel(ren.name(name), ch.src, ch.dsts, ch.depth)
        n = chunk.length
        if n:
            at, core = p.size(), p.core
            off = self._offset.get(core, 0)
            self._copied.setdefault(core, []).append((at + off, n, chunk.start, i - src))
            self._at.setdefault(core, []).append((at, n, chunk.start, i - src))
            self._offset[core] = off + n
        if chunk.fin:
            finishers[i].append(p.core)

    def _copy(self, shift: int, instrs: Sequence[Instr]) -> list[Instr]:
        return self._renamers[shift].copy(instrs)

    def attach(self, ps: ProgramSet) -> CopiedProgramSet:
        """``ps`` (built with this layering; its bodies hold the emitted instructions) with the
        copies in place (:class:`lowering.elk_copies.LayeredBody`) and marked."""
        at = self._at
        progs = tuple(
            Program(p.core, LayeredBody(p.body, at[p.core], self._copy))  # type: ignore[arg-type]
            if p.core in at
            else p
            for p in ps.programs
        )
        fields = {f: getattr(ps, f) for f in _PS_FIELDS}
        fields["programs"] = progs
        out = CopiedProgramSet(**fields)
        object.__setattr__(out, "copies", {c: tuple(v) for c, v in self._copied.items()})
        # the names of the templates, renamed for each shift they are copied at (on lookup)
        names = {d: (r._names, r._tensors) for d, r in self._renamers.items()}
        object.__setattr__(out, "renames", names)
        return out


_PS_FIELDS = tuple(f.name for f in dataclasses.fields(ProgramSet))


class CopiedProgramSet(ProgramSet):
    """A :class:`~lowering.isa.ProgramSet` that also says which ranges of each core's body are
    a layer's sections copied with every name shifted (ELK §4.4: equal layers): ``copies`` maps
    a core to ``(start, length, template start, shift)``, ``body[start:start+length]`` being
    ``body[template start:template start+length]`` renamed instruction by instruction (only
    names differ); ``renames[shift]`` is ``(buffer and channel names, tensor names)``, each a
    dict from a template's name to the copy's.  A simulator may compile a template once and run each copy from it with the
    copy's names bound (:mod:`runtime.program_layers`).  Equal to the plain program set with the
    same fields (the marks are a hint, not part of the programs)."""

    copies: dict[int, tuple[tuple[int, int, int, int], ...]]
    renames: dict[int, tuple[dict[str, str], dict[str, str]]]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ProgramSet):
            return all(getattr(self, f) == getattr(other, f) for f in _PS_FIELDS)
        return NotImplemented

    __hash__ = ProgramSet.__hash__


def _rel(name: str, base: int) -> tuple[int | None, str]:
    m = _LAYER.fullmatch(name)
    return (int(m[1]) - base, m[2]) if m else (None, name)


def find_layering(
    ops: Sequence[Operator],
    placed: Sequence[Placed],
    order: Sequence[int],
    issued: Sequence[int],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    links: Mapping[str, str],
    results: Collection[str],
    flow: Flow,
) -> Layering | None:
    """The equal sections of a stack of at least three layers (``Operator.layer`` of operator
    ``i`` is ``i // layer size``), or ``None`` when there is nothing to copy."""
    total = len(ops)
    if total == 0 or ops[0].layer != 0:
        return None
    size = next((i for i, o in enumerate(ops) if o.layer != 0), total)
    if total % size or total // size < 3:
        return None
    if any(o.layer != i // size for i, o in enumerate(ops)):
        return None
    users: dict[str, set[int]] = {}
    for j, op in enumerate(ops):
        for _, t in op.tensors:
            users.setdefault(links.get(t, t), set()).add(j)
    ids: dict[tuple, int] = {}
    sig: list[int] = []
    near: list[tuple[int, ...]] = []
    for j, (op, pl) in enumerate(zip(ops, placed)):
        base = j // size
        roles = tuple(
            (
                role,
                _rel(t, base),
                tensors.get(t),
                _rel(links[t], base) if t in links else None,
                t in results,
            )
            for role, t in op.tensors
        )
        key = (
            op.kind,
            op.dims,
            op.dtype,
            op.flops_per_elem,
            op.node,
            op.row_reduce,
            roles,
            pl.plan.kind,
            pl.plan.tiles,
            pl.rows,
            pl.cols,
            pl.cores,
        )
        sig.append(ids.setdefault(key, len(ids)))
        near.append(tuple(sorted({u - j for _, t in op.tensors for u in users[links.get(t, t)]})))
    first = [0] * total  # the preload positions of section i: first[i] .. issued[i]-1
    prev = 0
    for i in range(total):
        first[i] = prev
        prev = max(prev, issued[i])

    def section(i: int) -> tuple:
        pre = tuple(order[k] - i for k in range(first[i], issued[i]))
        touched = sorted({0, *pre, *near[i]})
        return (
            i == total - 1,
            pre,
            tuple((d, (i + d) // size - i // size, sig[i + d]) for d in touched),
        )

    source = [-1] * total
    for i in range(2 * size, total):
        t = size + i % size
        if section(t) == section(i):
            source[i] = t
    lay = Layering(size, source, flow)
    return lay if lay.copies else None
