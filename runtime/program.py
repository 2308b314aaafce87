"""Validate a :class:`~lowering.isa.ProgramSet` against a chip and compile every core's program to
a flat list of operations (:mod:`runtime.ops`).

Compilation resolves every name once (buffers to :class:`~runtime.state.Buf` objects, channels to
their FIFO state and precomputed route, tensors to their HBM placement, kernels to the registry
entry) and turns loops and branches into jumps, so the sequencer's hot loop does no lookups.
Checking happens here, before anything runs (the declarations: :mod:`runtime.checks`; each
instruction's names, shapes and regions as it is compiled), and every message names the core, the
instruction (:func:`runtime.checks.describe`) and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hwmodel.chip import Chip
from lowering.isa import (
    Alloc,
    Barrier,
    Compute,
    Free,
    If,
    Instr,
    Load,
    LoadValue,
    Loop,
    ProgramSet,
    Recv,
    RecvValue,
    Send,
    SendValue,
    Set,
    Store,
)
from runtime import ops, ops_comm, ops_control, ops_mem, ops_pick, ops_select, program_layers
from runtime.checks import check_declarations, describe
from runtime.errors import SimulationError
from runtime.layout import HbmLayout, TensorInfo
from runtime.network import Fabric
from runtime.program_local import ALLOC as _ALLOC
from runtime.program_local import FREE as _FREE
from runtime.program_local import H_ALLOC, H_FREE, LocalCompiler
from runtime.state import Buf, ChanState, Core, Group, fifo_depth

__all__ = ["compile_programs", "Compiled"]


class Compiled:
    """Cores (one per chip core), channel states by name, barrier groups by name; the tensors
    the programs ``load``, ``store`` and read ``values`` of (LoadValue)."""

    __slots__ = (
        "cores",
        "chans",
        "groups",
        "active",
        "load",
        "store",
        "values",
        "templates",
        "frames",
        "fifo_ends",
    )

    def __init__(self, cores: list[Core], chans: dict[str, ChanState], groups: dict[str, Group]):
        self.cores = cores
        self.chans = chans
        self.groups = groups
        self.active = [c for c in cores if c.code]
        self.load: set[str] = set()
        self.store: set[str] = set()
        self.values: set[str] = set()
        #: templates of copied layers and the cores' call frames (:mod:`runtime.program_layers`)
        self.templates: list[program_layers.Template] = []
        #: (by core id)
        self.frames: dict[int, program_layers.Frame] = {}
        #: every channel's FIFO ends, listed when first asked for (:mod:`runtime.backlog`)
        self.fifo_ends: list | None = None

    def rebind(self) -> None:
        """Templates back on their own names, frames cleared (after a replay)."""
        program_layers.reset(self.templates, self.frames.values())


def compile_programs(
    ps: ProgramSet,
    chip: Chip,
    fabric: Fabric,
    layout: HbmLayout,
    *,
    fast: bool,
    checked: bool = False,
    depths: Mapping[str, int] | None = None,
) -> Compiled:
    """Check ``ps`` against ``chip`` and compile it (``fast``: fast-forward compute-only loops;
    ``checked``: the caller validated ``ps`` with :func:`lowering.validate_programs`, whose
    checks include these declaration checks, so they are not repeated; ``depths``: channel
    name -> FIFO depth over the declared one, :meth:`runtime.Simulator.deepen`)."""
    if not checked:
        check_declarations(ps, chip)
    where = f"program set {ps.name!r}"
    # a message's route depends on its source and destinations only: the channels between
    # the same cores (one per ELK operator and layer) share it
    routes: dict[tuple[int, tuple[int, ...]], tuple] = {}
    chans: dict[str, ChanState] = {}
    default = fifo_depth(None, chip)
    for ch in ps.channels:
        dsts = ch.dsts if ch.dsts.__class__ is tuple else tuple(ch.dsts)
        key = (ch.src, dsts)
        roots = routes.get(key)
        if roots is None:
            roots = routes[key] = fabric.message_roots(ch.src, dsts)
        depth = depths.get(ch.name, ch.depth) if depths else ch.depth
        name = ch.name
        chans[name] = ChanState(name, ch.src, dsts, default if depth is None else depth, roots)
    groups = {name: Group(name, tuple(members)) for name, members in ps.barriers}
    cores = [Core(i) for i in range(chip.num_cores)]
    costs: dict[tuple, tuple] = {}
    regions: dict[tuple, tuple] = {}
    # what an instruction compiles to apart from its core, by the instruction object: a program
    # builder shares equal instructions between cores (lowering.builder, ``share=True``); ``ps``
    # holds every instruction for the whole compilation, so an ``id`` is never reused here;
    # a multicast channel's name -> {destination core: index} (:meth:`_Compiler.position`)
    shared: dict[int | str, Any] = {}
    compilers = [
        _Compiler(
            cores[prog.core], chans, groups, layout, fabric, fast, where, costs, regions, shared
        )
        for prog in ps.programs
    ]
    # a body's ranges marked as renamed copies of another range (equal layers, ELK §4.4:
    # lowering.elk_layers.CopiedProgramSet) run from that range, compiled once
    copies = getattr(ps, "copies", None) or {}
    renames = getattr(ps, "renames", None) or {}
    out = Compiled(cores, chans, groups)
    for comp, prog in zip(compilers, ps.programs):
        marks = copies.get(prog.core)
        if marks:
            tmpls, frame = program_layers.compile_layered(comp, prog.body, marks, renames)
            out.templates += tmpls
            out.frames[prog.core] = frame
        else:
            comp.run(prog.body)
    out.active = [c for c in cores if c.code]
    for comp in compilers:
        out.load |= comp.loads
        out.store |= comp.stores
        out.values |= comp.values
    return out


class _Compiler(LocalCompiler):
    def __init__(
        self,
        core: Core,
        chans: dict[str, ChanState],
        groups: dict[str, Group],
        layout: HbmLayout,
        fabric: Fabric,
        fast: bool,
        where: str,
        costs: dict[tuple, tuple],
        regions: dict[tuple, tuple],
        shared: dict[int | str, Any] | None = None,
    ):
        self.shared = {} if shared is None else shared  # see compile_programs
        self.costs = costs  # (kernel, params, dtype, outputs) -> (kernel, params, costs), shared
        self.regions = regions  # (region, tensor shape) -> compiled region (:meth:`region`), shared
        self.routed_load = False  # this core's HBM routes are built (:meth:`routes`)
        self.routed_store = False
        self.loads: set[str] = set()
        self.stores: set[str] = set()
        self.values: set[str] = set()
        self.fabric = fabric
        self.core = core
        self.bufs = core.bufs
        self.chans = chans
        self.groups = groups
        self.layout = layout
        self.fast = fast
        self.where = where
        self.code: list[ops.Op] = []
        self.slots = 0

    def fail(self, ins: Instr, msg: str) -> SimulationError:
        return SimulationError(f"{self.where}, core {self.core.id}, `{describe(ins)}`: {msg}")

    def run(self, body: Sequence[Instr]) -> None:
        self.block(body)
        self.code.append(ops.make(ops.Op, ops.h_end, None))
        self.core.code = self.code
        self.core.lc = [0] * self.slots
        self.core.li = [0] * self.slots

    def routes(self, load: bool) -> None:
        """Build (and cache) this core's HBM routes now rather than during the run."""
        if load:
            self.fabric.load_roots(self.core.id)
        else:
            self.fabric.store_roots(self.core.id)

    def buf(self, name: str) -> Buf:
        bufs = self.bufs
        b = bufs.get(name)
        if b is None:
            b = bufs[name] = Buf(name)
        return b

    def chan(self, ins: Instr, name: str, send: bool) -> ChanState:
        ch = self.chans.get(name)
        if ch is None:
            raise self.fail(
                ins,
                f"channel {name!r} is not declared in the program set; declare a Channel for it",
            )
        if send and ch.src != self.core.id:
            raise self.fail(
                ins, f"channel {name!r} is sent by core {ch.src}, not core {self.core.id}"
            )
        if not send and self.core.id not in ch.dsts:
            raise self.fail(
                ins, f"channel {name!r} delivers to cores {ch.dsts}, not core {self.core.id}"
            )
        return ch

    def position(self, ch: ChanState) -> int | None:
        """This core's index among ``ch``'s destinations (``None``: not one of them); a
        multicast to many cores (a synchronisation token to every worker) is indexed once."""
        me, dsts = self.core.id, ch.dsts
        if len(dsts) <= 16:
            return dsts.index(me) if me in dsts else None
        pos = self.shared.get(ch.name)
        if pos is None:
            pos = self.shared[ch.name] = {c: k for k, c in enumerate(dsts)}
        return pos.get(me)

    def tensor(self, ins: Instr, name: str):
        info = self.layout.tensors.get(name)
        if info is None:
            raise self.fail(ins, f"tensor {name!r} is not declared; add a TensorDecl")
        return info

    def block(self, body: Sequence[Instr]) -> None:
        handlers = _HANDLERS
        # Alloc, Free and Compute (most of a kernel program's instructions) inline: positional
        # construction, no handler call (compiling a large chip builds millions of operations)
        append, bufs, shared = self.code.append, self.bufs, self.shared
        for ins in body:
            cls = ins.__class__
            if cls is Alloc:
                fields = shared.get(id(ins))
                if fields is None:
                    fields = shared[id(ins)] = self.alloc_fields(ins)  # type: ignore[arg-type]
                b = bufs.get(ins.buf) or self.buf(ins.buf)  # type: ignore[union-attr]
                append(_ALLOC(H_ALLOC, ins, b, *fields))
                continue
            if cls is Free:
                b = bufs.get(ins.buf) or self.buf(ins.buf)  # type: ignore[union-attr]
                append(_FREE(H_FREE, ins, b))
                continue
            if cls is Compute:
                append(self.compute(ins))  # type: ignore[arg-type]
                continue
            handler = handlers.get(cls)
            if handler is None:
                self.one(ins)  # raises
            handler(self, ins)

    def one(self, ins: Instr) -> None:
        """Compile one instruction (dispatch on its exact type: the ISA's instruction classes are
        final frozen dataclasses)."""
        handler = _HANDLERS.get(type(ins))
        if handler is None:
            raise self.fail(ins, f"{type(ins).__name__} is not an instruction of lowering.isa")
        handler(self, ins)

    def _mem(self, ins: Load | Store) -> None:
        info = self.tensor(ins, ins.tensor)
        load = ins.__class__ is Load
        # a region's compiled form depends on the region and the tensor's shape only, so equal
        # regions (the same slice of every layer's weights, of every core's operand) are
        # compiled and checked once per program set
        key = (ins.region, info.shape)
        try:
            hit = self.regions.get(key)
        except TypeError:  # an unhashable region operand
            key, hit = None, None
        if hit is None:
            hit = self.region(ins, info)
            if key is not None:
                self.regions[key] = hit
        starts, extents, fixed, cext = hit
        if load:
            self.loads.add(info.name)
            if not self.routed_load:
                self.routes(True)
                self.routed_load = True
            name, fn, acc, bg = ins.dst, _H_LOAD, False, ins.background
        else:
            self.stores.add(info.name)
            if not self.routed_store:
                self.routes(False)
                self.routed_store = True
            name, fn, acc, bg = ins.src, _H_STORE, ins.accumulate, False
        b = self.bufs.get(name) or self.buf(name)
        self.code.append(_MEM(fn, ins, b, info, starts, extents, fixed, cext, acc, bg))

    def region(self, ins: Load | Store, info: TensorInfo) -> tuple:
        """``(starts, extents, fixed, cext)`` of a Load's or Store's region of tensor ``info``:
        compiled expressions (``None``: the whole tensor), the constant ``(starts, extents)``
        when there are no register operands, and the constant extents; bounds-checked."""
        if ins.region is None:
            return None, None, ((0,) * len(info.shape), info.shape), None
        r = ins.region
        if len(r.starts) != len(info.shape) or len(r.extents) != len(info.shape):
            raise self.fail(
                ins,
                f"region has {len(r.starts)}/{len(r.extents)} starts/extents for a {len(info.shape)}-d tensor",
            )
        if all(v.__class__ is int for v in r.starts) and all(
            v.__class__ is int for v in r.extents
        ):  # constants (most regions): ops.expr's form without its type dispatch
            starts = tuple([(v, ()) for v in r.starts])
            extents = tuple([(v, ()) for v in r.extents])
        else:
            starts = tuple(ops.expr(s) for s in r.starts)
            extents = tuple(ops.expr(e) for e in r.extents)
        fixed = None
        if all(not e[1] for e in starts + extents):
            s = tuple(e[0] for e in starts)
            x = tuple(e[0] for e in extents)
            if any(a < 0 or b < 0 or a + b > d for a, b, d in zip(s, x, info.shape)):
                raise self.fail(
                    ins,
                    f"region starts={s} extents={x} is outside tensor {info.name!r} of shape {info.shape}",
                )
            fixed = (s, x)
        cext = None if any(e[1] for e in extents) else tuple(e[0] for e in extents)
        return starts, extents, fixed, cext

    def _send(self, ins: Send | SendValue) -> None:
        ch = self.chans.get(ins.channel)
        if ch is None or ch.src != self.core.id:
            ch = self.chan(ins, ins.channel, True)  # raises
        if ins.__class__ is Send:
            b = self.bufs.get(ins.src) or self.buf(ins.src)  # type: ignore[union-attr]
            self.code.append(_SEND(_H_SEND, ins, ch, b, None))
        else:
            value = ops.expr(ins.value)  # type: ignore[union-attr]
            if ins.stop:  # type: ignore[union-attr]  # the stream's stop token
                value = ops_comm.StopExpr(value)
            self.code.append(_SEND(_H_SEND, ins, ch, None, value))

    def _recv(self, ins: Recv | RecvValue) -> None:
        code = self.code
        ch = self.chans.get(ins.channel)
        if ch is None:
            k = None
        else:  # position(), inlined for a unicast channel (most of them)
            dsts = ch.dsts
            k = (0 if dsts[0] == self.core.id else None) if len(dsts) == 1 else self.position(ch)
        if k is None:
            self.chan(ins, ins.channel, False)  # raises: not declared or not delivered here
        end = ch.ends[k]  # type: ignore[union-attr,index]
        if ins.__class__ is Recv:
            b = self.bufs.get(ins.dst) or self.buf(ins.dst)  # type: ignore[union-attr]
            stop = ins.stop  # type: ignore[union-attr]
            code.append(_RECV(_H_RECV if stop is None else _H_RECVSTOP, ins, end, b, stop))
        elif ins.stop is None:  # type: ignore[union-attr]
            code.append(_RECV(_H_RECVVALUE, ins, end, None, ins.reg))  # type: ignore[union-attr]
        else:  # a value or the stream's stop token
            regs = (ins.reg, ins.stop)  # type: ignore[union-attr]
            code.append(_RECV(ops_comm.h_recvvaluestop, ins, end, None, regs))

    def _loadvalue(self, ins: LoadValue) -> None:
        code, make = self.code, ops.make
        info = self.tensor(ins, ins.tensor)
        if not info.is_int:
            raise self.fail(
                ins,
                f"tensor {info.name!r} is {info.dtype}; LoadValue reads integer tensors only",
            )
        if len(ins.index) != len(info.shape):
            raise self.fail(
                ins, f"index has {len(ins.index)} entries for a {len(info.shape)}-d tensor"
            )
        self.routes(True)
        self.values.add(info.name)
        code.append(
            make(
                ops_mem.OpLoadValue,
                ops_mem.h_loadvalue,
                ins,
                reg=ins.reg,
                info=info,
                index=tuple(ops.expr(i) for i in ins.index),
            )
        )

    def _barrier(self, ins: Barrier) -> None:
        code, make = self.code, ops.make
        g = self.groups.get(ins.group)
        if g is None:
            raise self.fail(
                ins, f"barrier group {ins.group!r} is not declared in ProgramSet.barriers"
            )
        if self.core.id not in g.members:
            raise self.fail(
                ins,
                f"core {self.core.id} is not a member of barrier group {ins.group!r} {g.members}",
            )
        code.append(make(ops_comm.OpBarrier, ops_comm.h_barrier, ins, group=g))


_MEM = ops.builder(ops_mem.OpMem)
_SEND = ops.builder(ops_comm.OpSend)
_RECV = ops.builder(ops_comm.OpRecv)
_H_LOAD, _H_STORE, _H_SEND = ops_mem.h_load, ops_mem.h_store, ops_comm.h_send
_H_RECV, _H_RECVSTOP, _H_RECVVALUE = ops_comm.h_recv, ops_comm.h_recvstop, ops_comm.h_recvvalue

_HANDLERS = {
    Compute: LocalCompiler._compute,
    Load: _Compiler._mem,
    Store: _Compiler._mem,
    Send: _Compiler._send,
    SendValue: _Compiler._send,
    Recv: _Compiler._recv,
    RecvValue: _Compiler._recv,
    LoadValue: _Compiler._loadvalue,
    Set: LocalCompiler._set,
    Alloc: LocalCompiler._alloc,
    Free: LocalCompiler._free,
    Barrier: _Compiler._barrier,
    Loop: LocalCompiler.loop,
    If: LocalCompiler._if,
}
_HANDLERS.update(ops_control.COMPILERS)  # control values computed on a core
_HANDLERS.update(ops_select.COMPILERS)  # a choice among channels in simulated time
_HANDLERS.update(ops_pick.COMPILERS)  # the least of several registers
