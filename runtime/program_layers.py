"""Equal layers compiled once (ELK §4.4: the decoder layers of a step are the same operators
with the same plans, preload order and issue points, so their per-core programs differ only in
the names of buffers, tensors and channels).

A :class:`lowering.elk_layers.CopiedProgramSet` marks the ranges of each core's body that are
renamed copies of an earlier range, their *template*.  The template is compiled as usual, once,
followed by an :class:`OpRet`; each copy compiles to one :class:`OpCall` holding a *table*: the
objects the copy's names resolve to (its buffers, created in the order compiling the copy would
create them, its tensors' placements, its channels' states and FIFO ends), one entry per
distinct name in the name-bearing fields of the template's operations (:class:`Template`).  When
the core reaches the call, the template's operations are bound to the table (one attribute store
per name-bearing field) and the core jumps to the template; the return jumps back.  The
operations the template then runs are field for field the ones compiling the copy would have
built (same handlers, kernels, cost caches, regions and objects), so cycles, statistics and
traces are those of compiling every copy, while compiling costs one table per copy instead of
one operation per instruction.  The call and the return are bookkeeping, not instructions: they
do not count as executed operations (``Core.stepped``).  A run-time error inside a copy names
the template's instruction (the copy's with layer 1's names).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lowering.isa import Alloc, Compute, Free, Instr, Load, Recv, RecvValue, Send, SendValue, Store
from runtime import ops
from runtime.backlog import backlog
from runtime.errors import SimulationError
from runtime.state import Buf

__all__ = ["Template", "Frame", "OpCall", "OpRet", "compile_layered", "h_call", "h_ret", "bind"]

#: instruction class -> (operation field, instruction field, kind) of each name it holds,
#: in the order :class:`runtime.program._Compiler` resolves them (buffers are created in that
#: order, which fixes the order of ``Core.bufs``)
_FIELDS: dict[type, tuple[tuple[str, str, str], ...]] = {
    Alloc: (("buf", "buf", "b"),),
    Free: (("buf", "buf", "b"),),
    Compute: (("outs", "outs", "bt"), ("ins", "ins", "bt")),
    Load: (("info", "tensor", "tl"), ("buf", "dst", "b")),
    Store: (("info", "tensor", "ts"), ("buf", "src", "b")),
    Send: (("chan", "channel", "cs"), ("buf", "src", "b")),
    SendValue: (("chan", "channel", "cs"),),
    Recv: (("end", "channel", "ce"), ("buf", "dst", "b")),
    RecvValue: (("end", "channel", "ce"),),
}


class Template:
    """A template range compiled once: its operations ``code[start:stop]`` (the return at
    ``stop``); the names its operations bind, by kind: buffers (``bnames``, each once, in the
    order of their first mention; a Compute's buffer tuples as positions ``bt`` in it), sent
    channels (``cnames``), received channels and
    the FIFO end of this core (``enames``, ``eidx``), tensors (``tnames``; ``tload``: read by a
    Load); per operation field the operations and table positions to bind (``binds``:
    ``(setter, operations, positions)``; a field naming a buffer local to the section is
    bound once, when compiled, see :attr:`kept`); its own table (``home``).  A table lists the
    buffers, the buffer tuples, the channels, the FIFO ends and the tensors, in that order."""

    __slots__ = (
        "start", "stop", "bnames", "bt", "cnames", "cobjs", "enames", "eidx", "eobjs",
        "tnames", "tload", "tobjs", "binds", "home", "sig", "kept", "kept_bt",
    )  # fmt: skip

    def __init__(self, start: int, stop: int) -> None:
        self.start = start
        self.stop = stop
        self.bnames: list[str] = []
        self.bt: list[tuple[int, ...]] = []
        self.cnames: list[str] = []
        self.cobjs: list[Any] = []
        self.enames: list[str] = []
        self.eidx: list[int] = []
        self.eobjs: list[Any] = []
        self.tnames: list[str] = []
        self.tload: list[bool] = []
        self.tobjs: list[Any] = []
        self.binds: list[tuple[Any, list[ops.Op], list[int]]] = []
        self.home: list[Any] = []
        #: the buffer names and tensors the template binds (and which tensors are loaded), one
        #: object for every template of the program set that binds the same ones
        #: (:func:`_table` renames them once per copy for all those templates)
        self.sig: tuple = ()
        #: positions in ``bnames`` of the buffers that outlive the template range (a copy
        #: makes its own); the others are the section's own (:func:`_local`) and every copy
        #: of the template on this core binds the template's buffer object instead
        self.kept: tuple[int, ...] = ()
        #: per buffer tuple of ``bt``: whether it holds a kept buffer (else the template's
        #: tuple is bound as it is)
        self.kept_bt: tuple[bool, ...] = ()


def bind(t: Template, table: Sequence[Any]) -> None:
    """Point ``t``'s operations at ``table``'s objects."""
    get = table.__getitem__
    for setter, targets, slots in t.binds:
        for _ in map(setter, targets, map(get, slots)):
            pass


class Frame:
    """A core's call state: the template running for a copy (``None``: none) and where the
    copy's caller goes on; ``spans``: the ``(start, stop)`` of the core's templates."""

    __slots__ = ("tmpl", "back", "spans")

    def __init__(self) -> None:
        self.tmpl: Template | None = None
        self.back = 0
        self.spans: tuple[tuple[int, int], ...] = ()


class OpCall(ops.Op):
    """Run template ``tmpl`` with ``table`` bound, then go on after this operation (``shift``:
    the copy's shift, see :func:`compile_layered`)."""

    __slots__ = ("fr", "tmpl", "table", "shift")


class OpRet(ops.Op):
    """The end of template ``tmpl``: back to the caller when a copy called it, else on."""

    __slots__ = ("fr", "tmpl")


def h_call(sim: Any, core: Any, op: OpCall) -> bool:
    bind(op.tmpl, op.table)
    rec = sim.copy_starts
    if rec is not None:  # (runtime.Simulator.run(copy_starts=True))
        rec.append((core.id, op.tmpl.start, op.shift, core.t, tuple(core.st)))
        marks = sim.copy_marks
        if op.shift not in marks:  # a layer's first copy: the shared state (runtime.backlog)
            marks[op.shift] = (core.id, op.tmpl.start, sim.now, backlog(sim, op.shift))
    fr = op.fr
    fr.tmpl = op.tmpl
    fr.back = core.pc + 1
    core.pc = op.tmpl.start
    core.stepped -= 1  # bookkeeping, not an instruction (the loop counts it)
    return True


def h_ret(sim: Any, core: Any, op: OpRet) -> bool:
    fr = op.fr
    if fr.tmpl is op.tmpl:
        fr.tmpl = None
        core.pc = fr.back
    else:
        core.pc += 1
    core.stepped -= 1
    return True


def r_call(sim: Any, core: Any, op: OpCall) -> bool:
    """:func:`h_call` for the untimed replay (which counts no operations)."""
    core.stepped += 1
    return h_call(sim, core, op)


def r_ret(sim: Any, core: Any, op: OpRet) -> bool:
    core.stepped += 1
    return h_ret(sim, core, op)


def reset(templates: Sequence[Template], frames: Iterable[Frame]) -> None:
    """Bind every template to its own names again and clear the frames (a replay's
    :meth:`runtime.replay.Replay.close` hands the compiled programs back)."""
    for t in templates:
        bind(t, t.home)
    for f in frames:
        f.tmpl = None
        f.back = 0


def compile_layered(
    comp: Any,
    body: Sequence[Instr],
    copies: Sequence[tuple[int, int, int, int]],
    renames: Mapping[int, tuple[Mapping[str, str], Mapping[str, str]]],
) -> tuple[list[Template], Frame]:
    """Compile ``body`` with compiler ``comp`` (:class:`runtime.program._Compiler`; its
    :meth:`run` for a body with ``copies``: ``(start, length, template start, shift)``, and
    ``renames[shift]``: the buffer / channel and tensor names of the copies, see the module
    docstring).  A template whose operations are not one per instruction of the kinds a copy
    holds is compiled as usual, and so are its copies and any copy a name is missing for."""
    fr = Frame()
    length = {t: n for _, n, t, _ in copies}
    marks = sorted([(t, n, -1, 0) for t, n in length.items()] + list(copies))
    tmpls: dict[int, Template] = {}
    code = comp.code
    pos = 0
    for s, n, t, d in marks:
        if s < pos:  # overlapping marks: not a layering this compiler understands
            raise SimulationError(f"core {comp.core.id}: copied ranges overlap at {s}")
        if s > pos:
            comp.block(body[pos:s])
        pos = s + n
        if t < 0:
            pc0 = len(code)
            comp.block(body[s:pos])
            tm = _template(comp, body, s, n, pc0)
            if tm is not None:
                tmpls[s] = tm
                code.append(_RET(h_ret, None, fr, tm))
            continue
        tm = tmpls.get(t)
        table = None
        if tm is not None and length[t] == n and d in renames:
            try:
                table = _table(comp, tm, *renames[d])
            except KeyError:  # a name not renamed or not declared: compiled as usual
                table = None
        if table is None:
            comp.block(body[s:pos])
        else:
            code.append(_CALL(h_call, None, fr, tm, table, d))
    comp.block(body[pos:])
    code.append(ops.make(ops.Op, ops.h_end, None))
    core = comp.core
    core.code = code
    core.lc = [0] * comp.slots
    core.li = [0] * comp.slots
    fr.spans = tuple((tm.start, tm.stop) for tm in tmpls.values())
    return list(tmpls.values()), fr


def _template(comp: Any, body: Sequence[Instr], s: int, n: int, pc0: int) -> Template | None:
    code = comp.code
    if len(code) - pc0 != n:
        return None
    tm = Template(pc0, pc0 + n)
    index: dict[tuple[str, Any], tuple[str, int]] = {}
    groups: dict[tuple[type, str], tuple[list[ops.Op], list[tuple[str, int]]]] = {}
    bnames, bt = tm.bnames, tm.bt
    bpos: dict[str, int] = {}  # a buffer name's position in bnames (each name once)
    hb: list[Any] = []  # the template's own objects, in table order (its home table)
    hbt: list[Any] = []
    ce: list[Any] = []
    field_of = _FIELDS.get
    for ins, op in zip(body[s : s + n], code[pc0:]):
        fields = field_of(ins.__class__)
        if fields is None or op.src is not ins:
            return None
        cls = op.__class__
        for of, inf, kind in fields:
            name = getattr(ins, inf)
            key = (kind, name)
            ref = index.get(key)
            if ref is None:
                obj = getattr(op, of)
                if kind == "b":
                    k = bpos.get(name)
                    if k is None:
                        k = bpos[name] = len(bnames)
                        bnames.append(name)
                        hb.append(obj)
                    ref = ("b", k)
                elif kind == "bt":
                    ref = ("bt", len(bt))
                    for x, bo in zip(name, obj):
                        if x not in bpos:
                            bpos[x] = len(bnames)
                            bnames.append(x)
                            hb.append(bo)
                    bt.append(tuple([bpos[x] for x in name]))
                    hbt.append(obj)
                elif kind == "cs":
                    ref = ("cs", len(tm.cnames))
                    tm.cnames.append(name)
                    tm.cobjs.append(obj)
                elif kind == "ce":
                    ref = ("ce", len(tm.enames))
                    tm.enames.append(name)
                    tm.eidx.append(comp.position(obj.chan) if len(obj.chan.ends) > 1 else 0)
                    tm.eobjs.append(obj.chan)
                    ce.append(obj)
                else:
                    ref = ("t", len(tm.tnames))
                    tm.tnames.append(name)
                    tm.tload.append(kind == "tl")
                    tm.tobjs.append(obj)
                index[key] = ref
            g = groups.get((cls, of))
            if g is None:
                g = groups[(cls, of)] = ([], [])
            g[0].append(op)
            g[1].append(ref)
    own = _local(body, s, n)
    tm.kept = tuple([k for k, x in enumerate(bnames) if x not in own])
    tm.kept_bt = tuple([any(bnames[k] not in own for k in ix) for ix in bt])
    # a field naming a section-local buffer (or a tuple of them) holds the same object in
    # every table: it keeps the template's binding and is never bound again
    fixed = {("b", k) for k, x in enumerate(bnames) if x in own}
    fixed |= {("bt", k) for k, m in enumerate(tm.kept_bt) if not m}
    nb, nbt, nc, ne = len(bnames), len(bt), len(tm.cnames), len(tm.enames)
    base = {"b": 0, "bt": nb, "cs": nb + nbt, "ce": nb + nbt + nc, "t": nb + nbt + nc + ne}
    tm.binds = []
    for (cls, of), (targets, refs) in groups.items():
        keep = [k for k, ref in enumerate(refs) if ref not in fixed]
        if keep:
            tm.binds.append(
                (
                    getattr(cls, of).__set__,
                    [targets[k] for k in keep],
                    [base[refs[k][0]] + refs[k][1] for k in keep],
                )
            )
    tm.home = hb + hbt + tm.cobjs + ce + tm.tobjs
    kept = tuple([bnames[k] for k in tm.kept])
    sig = (kept, tuple(tm.tnames), tuple(tm.tload))
    tm.sig = comp.shared.setdefault(_SIGS, {}).setdefault(sig, sig)
    return tm


def _local(body: Sequence[Instr], s: int, n: int) -> set[str]:
    """The buffers of ``body[s:s+n]`` that live only there: first mentioned by an Alloc,
    every later mention while allocated, freed by the range's last mention of them.

    A copy of the range runs after the range (and after every earlier copy) on the same core,
    each allocating and freeing such a buffer between its own instructions, so the copies can
    run on the template's buffer object: a freed buffer's state (``Buf.w`` and ``Buf.r`` no
    later than the core's clock, no pending access: :func:`runtime.ops.h_free` waits for them)
    acts as a fresh one's for every later instruction, which compares those cycles with the
    core's clock only.  The buffers a copy makes then are those it shares with other sections
    (preloaded weights and KV pieces, ELK §4.5), not one per tile and layer."""
    live: dict[str, bool] = {}  # name -> allocated now
    get = live.get
    bad: set[str] = set()
    for ins in body[s : s + n]:
        cls = ins.__class__
        if cls is Alloc:
            x = ins.buf  # type: ignore[attr-defined]
            if get(x, False):
                bad.add(x)
            live[x] = True
        elif cls is Free:
            x = ins.buf  # type: ignore[attr-defined]
            if not get(x, False):
                bad.add(x)
            live[x] = False
        elif cls is Compute:
            for x in ins.outs + ins.ins:  # type: ignore[attr-defined]
                if not get(x, False):
                    bad.add(x)
        else:
            attr = _BUF_OF.get(cls)
            if attr is not None:
                x = getattr(ins, attr)
                if not get(x, False):
                    bad.add(x)
    return {x for x, on in live.items() if not on and x not in bad}


#: the buffer field of the other instructions a copy holds (SendValue, RecvValue: none)
_BUF_OF = {Load: "dst", Recv: "dst", Store: "src", Send: "src"}


def _table(
    comp: Any, tm: Template, names: Mapping[str, str], tensors: Mapping[str, str]
) -> list[Any]:
    """The objects a copy of ``tm`` binds, its names being ``names`` / ``tensors`` of the
    template's; checked once per name against the template's (a copy differs in names only).
    ``KeyError``: a name is not renamed or not declared.

    Most cores' templates bind the same buffer names and tensors (a layer's programs reuse
    buffer names on every core), so the renamed buffer names and the copy's tensors are worked
    out once per distinct :attr:`Template.sig` and copy (:func:`_shared`); each core then
    creates its own buffers, in the order compiling the copy would (``Core.bufs`` keeps it):
    the order of their first mention, each name once."""
    memo = comp.shared.get(_MEMO)
    if memo is None:
        memo = comp.shared[_MEMO] = {}
    key = (id(tm.sig), id(names), id(tensors))
    got = memo.get(key)
    if got is None:
        got = memo[key] = _shared(comp, tm, names, tensors)
    bufs = comp.bufs
    get = bufs.get
    kb = []
    add = kb.append
    for x in got[0]:
        y = get(x)
        if y is None:
            y = bufs[x] = Buf(x)
        add(y)
    nb = len(tm.bnames)
    if len(kb) == nb:  # no buffer of the section is its own
        b = kb
    else:
        b = tm.home[:nb]
        for k, y in zip(tm.kept, kb):
            b[k] = y
    at = b.__getitem__
    if tm.bt:
        hbt = tm.home[nb : nb + len(tm.bt)]
        b += [tuple(map(at, ix)) if fresh else t for ix, fresh, t in zip(tm.bt, tm.kept_bt, hbt)]
    chans = comp.chans
    cn = list(map(names.__getitem__, tm.cnames))
    cs = list(map(chans.__getitem__, cn))
    en = list(map(names.__getitem__, tm.enames))
    ec = list(map(chans.__getitem__, en))
    seen = comp.shared.setdefault(("copied",), set())
    if not seen.issuperset(cn) or not seen.issuperset(en):
        _check(comp, seen, zip(cn, cs, tm.cobjs), zip(en, ec, tm.eobjs), ())
    b += cs
    b += [c.ends[i] for c, i in zip(ec, tm.eidx)]
    b += got[1]
    return b


def _shared(
    comp: Any, tm: Template, names: Mapping[str, str], tensors: Mapping[str, str]
) -> tuple[tuple[str, ...], list[Any]]:
    """What a copy of ``tm`` binds that is not one core's (:func:`_table`): its buffer names
    and its tensors, checked against the template's and counted as loaded or stored (the
    program set's loads and stores are the union over its cores)."""
    bn = tuple([names[tm.bnames[k]] for k in tm.kept])
    tn = list(map(tensors.__getitem__, tm.tnames))
    ts = list(map(comp.layout.tensors.__getitem__, tn))
    seen = comp.shared.setdefault(("copied",), set())
    if not seen.issuperset(tn):
        _check(comp, seen, (), (), zip(tn, ts, tm.tobjs))
    for name, load in zip(tn, tm.tload):
        (comp.loads if load else comp.stores).add(name)
    return bn, ts


def _check(comp: Any, seen: set[str], sent: Any, received: Any, tensors: Any) -> None:
    """A copy's channels join the cores its template's join; its tensors have the template's
    shapes and dtypes (each name checked once per program set)."""
    for name, ch, tc in (*sent, *received):
        if name not in seen:
            if ch.src != tc.src or (ch.dsts is not tc.dsts and ch.dsts != tc.dsts):
                raise SimulationError(
                    f"core {comp.core.id}: channel {name!r} joins other cores than "
                    f"{tc.name!r}, whose copy it is"
                )
            seen.add(name)
    for name, info, ti in tensors:
        if name not in seen:
            if info.shape != ti.shape or info.dtype != ti.dtype:
                raise SimulationError(
                    f"core {comp.core.id}: tensor {name!r} {info.shape} {info.dtype} is not "
                    f"shaped as {ti.name!r}, whose copy it is"
                )
            seen.add(name)


#: keys in the compilers' shared dict: the distinct template signatures, the shared parts of
#: the tables (:func:`_table`)
_SIGS = ("program_layers", "sigs")
_MEMO = ("program_layers", "tables")

_CALL = ops.builder(OpCall)
_RET = ops.builder(OpRet)
