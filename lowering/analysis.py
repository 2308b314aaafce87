"""Static analysis of per-core programs: live SRAM buffers and their peak, defined registers,
declared names, and static message / barrier counts (Cyclotron §6: every receive has a matching
send, known before running).

A count is an ``int`` when every enclosing loop has a literal count and both arms of every
enclosing branch agree; it is ``None`` when it depends on run-time values (a loop over a
received count), in which case the static message-count check is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lowering.analysis_result import CoreAnalysis, Count, ProgramAnalysis
from lowering.analysis_result import add_counts as _add
from lowering.analysis_result import mul_counts as _mul
from lowering.isa import (
    CALC_OPS,
    DTYPE_BYTES,
    Affine,
    Alloc,
    ArgMin,
    Barrier,
    Calc,
    Channel,
    Compute,
    Free,
    If,
    Index,
    Instr,
    Load,
    LoadValue,
    Loop,
    Operand,
    Program,
    ProgramSet,
    ReadValue,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
    Store,
    TensorDecl,
    WaitAny,
    WriteValue,
)
from lowering.kernels import KERNELS
from lowering.printer import format_instr

__all__ = ["Count", "CoreAnalysis", "ProgramAnalysis", "analyze_programs"]

#: Position of an instruction: 1-based indices through nested bodies (``(3, 1)`` = first
#: instruction of the body of the third).
Path = tuple[int, ...]

_INT_DTYPES = frozenset({"int8", "int32", "int64", "bool"})


@dataclass(slots=True)
class _Counts:
    sends: dict[tuple[str, str], Count] = field(default_factory=dict)
    recvs: dict[tuple[str, str], Count] = field(default_factory=dict)
    sent_bytes: dict[str, Count] = field(default_factory=dict)
    barriers: dict[str, Count] = field(default_factory=dict)

    def merge_branches(self, then: _Counts, orelse: _Counts) -> None:
        """Add the counts of an ``If``: equal in both arms -> that count, else unknown."""
        for name in ("sends", "recvs", "sent_bytes", "barriers"):
            mine, a, b = getattr(self, name), getattr(then, name), getattr(orelse, name)
            for key in sorted(set(a) | set(b), key=str):
                va, vb = a.get(key, 0), b.get(key, 0)
                mine[key] = _add(mine.get(key, 0), va if va == vb else None)


class _Live(dict[str, tuple[tuple[int, ...], str, int]]):
    """Live buffers (buf -> (shape, dtype, bytes)) and their byte total, kept as buffers are
    allocated and freed (the SRAM peak is then O(1) per Alloc, not a sum over the live set).
    A buffer allocated ``held`` (:class:`~lowering.isa.Alloc`) is not in the total: what it
    holds is known only when the program runs, and the simulator accounts it then."""

    total: int = 0
    held: frozenset[str] = frozenset()

    def add(self, buf: str, entry: tuple[tuple[int, ...], str, int], held: bool = False) -> None:
        self[buf] = entry
        if held:
            self.held = self.held | {buf}
        else:
            self.total += entry[2]

    def remove(self, buf: str) -> None:
        nbytes = self.pop(buf)[2]
        if buf in self.held:
            self.held = self.held - {buf}
        else:
            self.total -= nbytes

    def copy(self) -> _Live:  # type: ignore[override]
        out = _Live(self)
        out.total = self.total
        out.held = self.held
        return out


@dataclass(slots=True)
class _State:
    live: _Live  # buf -> (shape, dtype, bytes)
    regs: set[str]

    def copy(self) -> _State:
        return _State(self.live.copy(), set(self.regs))


def _value_regs(value: Operand | Affine | Index) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, Affine):
        return {name for name, _ in value.terms}
    return set()


def _buffer_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 0)


class _Walker:
    """Walks one program, recording counts, the SRAM peak and problems."""

    def __init__(self, ps: ProgramSet, program: Program, problems: list[str]) -> None:
        self.core = program.core
        self.program = program
        self.problems = problems
        self.tensors: dict[str, TensorDecl] = {t.name: t for t in ps.tensors}
        self.channels: dict[str, Channel] = {c.name: c for c in ps.channels}
        self.barriers: dict[str, tuple[int, ...]] = dict(ps.barriers)
        self.peak = 0
        self.peak_live: tuple[tuple[str, int], ...] = ()
        # the live set at the latest peak, listed into ``peak_live`` only when it next changes
        # (a run of Allocs each raising the peak then lists it once, not once per Alloc)
        self.peak_src: _Live | None = None
        self.dtypes: set[str] = set()

    # -- helpers -------------------------------------------------------------------------------
    def problem(self, path: Path, instr: Instr, what: str) -> None:
        where = ".".join(str(p) for p in path)
        self.problems.append(f"core {self.core}, instr {where} `{format_instr(instr)}`: {what}")

    def need_regs(
        self, path: Path, instr: Instr, state: _State, *values: Operand | Affine | Index
    ) -> None:
        for value in values:
            for reg in sorted(_value_regs(value) - state.regs):
                self.problem(
                    path,
                    instr,
                    f"register {reg!r} is read before it is defined; set it first (set, "
                    "recv_value, load_value or a loop variable), or in both arms of an if",
                )

    def need_buf(self, path: Path, instr: Instr, state: _State, buf: str) -> None:
        if buf not in state.live:
            self.problem(
                path,
                instr,
                f"buffer {buf!r} is not allocated here; add `alloc {buf}` before this "
                "instruction (and no `free` in between)",
            )

    def need_tensor(self, path: Path, instr: Instr, name: str) -> TensorDecl | None:
        decl = self.tensors.get(name)
        if decl is None:
            known = ", ".join(sorted(self.tensors)) or "none"
            self.problem(
                path,
                instr,
                f"tensor {name!r} is not declared; declare it in the program set "
                f"(declared tensors: {known})",
            )
        return decl

    def need_channel(self, path: Path, instr: Instr, name: str, sending: bool) -> bool:
        ch = self.channels.get(name)
        if ch is None:
            known = ", ".join(sorted(self.channels)) or "none"
            self.problem(
                path,
                instr,
                f"channel {name!r} is not declared; declare it with its src and dsts "
                f"(declared channels: {known})",
            )
            return False
        if sending and ch.src != self.core:
            self.problem(
                path,
                instr,
                f"channel {name!r} is declared with src = core {ch.src}, so core {self.core} "
                f"cannot send on it; send from core {ch.src} or declare a channel with "
                f"src={self.core}",
            )
            return False
        if not sending and self.core not in ch.dsts:
            self.problem(
                path,
                instr,
                f"core {self.core} is not a destination of channel {name!r} (dsts "
                f"{list(ch.dsts)}); add {self.core} to its dsts or receive on another channel",
            )
            return False
        return True

    def check_region(
        self,
        path: Path,
        instr: Instr,
        state: _State,
        decl: TensorDecl | None,
        region: Region | None,
    ) -> int | None:
        """Rank, register use, literal bounds; returns the static element count or None."""
        if region is None:
            return math.prod(decl.shape) if decl else None
        self.need_regs(path, instr, state, *region.starts, *region.extents)
        if decl is None:
            return None
        if len(region.starts) != len(decl.shape) or len(region.extents) != len(decl.shape):
            self.problem(
                path,
                instr,
                f"region has {len(region.starts)} starts / {len(region.extents)} extents but "
                f"tensor {decl.name!r} has rank {len(decl.shape)}; give one per dimension",
            )
            return None
        static = True
        for dim, (start, extent, size) in enumerate(zip(region.starts, region.extents, decl.shape)):
            if isinstance(start, int) and isinstance(extent, int):
                if start < 0 or extent < 0 or start + extent > size:
                    self.problem(
                        path,
                        instr,
                        f"region [{start}:{start + extent}] of dimension {dim} is outside "
                        f"tensor {decl.name!r} (size {size}); keep 0 <= start and "
                        "start + extent <= size",
                    )
            if not isinstance(extent, int):
                static = False
        return math.prod(region.extents) if static else None  # type: ignore[arg-type]

    def fits(self, path: Path, instr: Instr, state: _State, buf: str, elements: int | None) -> None:
        if elements is None or buf not in state.live:
            return
        shape = state.live[buf][0]
        if elements > math.prod(shape):
            self.problem(
                path,
                instr,
                f"moves {elements} elements into buffer {buf!r} of capacity {math.prod(shape)} "
                f"({list(shape)}); allocate a larger buffer or move a smaller region",
            )

    # -- instructions (table :data:`_RULES` below) ---------------------------------------------
    def alloc(self, path: Path, i: Alloc, state: _State, counts: _Counts, mult: Count) -> None:
        if i.dtype not in DTYPE_BYTES:
            self.problem(path, i, f"unknown dtype {i.dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        if not i.shape or any(not isinstance(d, int) or d < 1 for d in i.shape):
            self.problem(path, i, f"shape {list(i.shape)} must be positive integers")
        if i.buf in state.live:
            self.problem(
                path,
                i,
                f"buffer {i.buf!r} is already allocated; free it first or pick another name",
            )
            return
        nbytes = _buffer_bytes(i.shape, i.dtype)
        total = state.live.total + (0 if i.held else nbytes)
        if total <= self.peak:
            self.settle_peak()
        state.live.add(i.buf, (i.shape, i.dtype, nbytes), i.held)
        if total > self.peak:
            self.peak = total
            self.peak_src = state.live

    def settle_peak(self) -> None:
        """List the live set of the latest peak before any live set changes."""
        if self.peak_src is not None:
            self.peak_live = tuple((name, b) for name, (_, _, b) in self.peak_src.items())
            self.peak_src = None

    def free(self, path: Path, i: Free, state: _State, counts: _Counts, mult: Count) -> None:
        if i.buf not in state.live:
            self.problem(path, i, f"buffer {i.buf!r} is not allocated; remove this free")
            return
        self.settle_peak()
        state.live.remove(i.buf)

    def load(self, path: Path, i: Load, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_buf(path, i, state, i.dst)
        decl = self.need_tensor(path, i, i.tensor)
        self.fits(path, i, state, i.dst, self.check_region(path, i, state, decl, i.region))

    def store(self, path: Path, i: Store, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_buf(path, i, state, i.src)
        decl = self.need_tensor(path, i, i.tensor)
        self.check_region(path, i, state, decl, i.region)

    def send(self, path: Path, i: Send, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_buf(path, i, state, i.src)
        self.need_channel(path, i, i.channel, sending=True)
        key = (i.channel, "data")
        counts.sends[key] = _add(counts.sends.get(key, 0), mult)
        nbytes = state.live[i.src][2] if i.src in state.live else 0
        counts.sent_bytes[i.channel] = _add(counts.sent_bytes.get(i.channel, 0), _mul(mult, nbytes))

    def recv(self, path: Path, i: Recv, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_buf(path, i, state, i.dst)
        self.need_channel(path, i, i.channel, sending=False)
        key = (i.channel, "data")
        if i.stop is None:
            counts.recvs[key] = _add(counts.recvs.get(key, 0), mult)
            return
        # one message, data or the stop token: which one only the run knows
        counts.recvs[key] = None
        counts.recvs[(i.channel, "value")] = None
        state.regs.add(i.stop)

    def send_value(
        self, path: Path, i: SendValue, state: _State, counts: _Counts, mult: Count
    ) -> None:
        self.need_regs(path, i, state, i.value)
        self.need_channel(path, i, i.channel, sending=True)
        key = (i.channel, "value")
        counts.sends[key] = _add(counts.sends.get(key, 0), mult)

    def recv_value(
        self, path: Path, i: RecvValue, state: _State, counts: _Counts, mult: Count
    ) -> None:
        self.need_channel(path, i, i.channel, sending=False)
        key = (i.channel, "value")
        counts.recvs[key] = _add(counts.recvs.get(key, 0), mult)
        state.regs.add(i.reg)
        if i.stop is not None:  # one value message either way: a value or the stop token
            state.regs.add(i.stop)

    def wait_any(self, path: Path, i: WaitAny, state: _State, counts: _Counts, mult: Count) -> None:
        """A choice among channels: it takes no message (the receive after it does)."""
        if not i.channels:
            self.problem(path, i, "wait_any names no channel; give it at least one")
        for name in i.channels:
            self.need_channel(path, i, name, sending=False)
        state.regs.add(i.reg)

    def load_value(
        self, path: Path, i: LoadValue, state: _State, counts: _Counts, mult: Count
    ) -> None:
        self.need_regs(path, i, state, *i.index)
        decl = self.need_tensor(path, i, i.tensor)
        if decl is not None:
            if len(i.index) != len(decl.shape):
                self.problem(
                    path,
                    i,
                    f"index has {len(i.index)} entries but tensor {decl.name!r} has rank "
                    f"{len(decl.shape)}",
                )
            if decl.dtype not in _INT_DTYPES:
                self.problem(
                    path,
                    i,
                    f"load_value reads control values from integer tensors; {decl.name!r} is "
                    f"{decl.dtype} (declare it int32/int64)",
                )
        state.regs.add(i.reg)

    def compute(self, path: Path, i: Compute, state: _State, counts: _Counts, mult: Count) -> None:
        if i.kernel not in KERNELS:
            self.problem(
                path,
                i,
                f"unknown kernel {i.kernel!r}; registered kernels: {', '.join(sorted(KERNELS))} "
                "(add one with lowering.kernels.register_kernel)",
            )
        if i.dtype not in DTYPE_BYTES:
            self.problem(path, i, f"unknown dtype {i.dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        self.dtypes.add(i.dtype)
        for buf in (*i.ins, *i.outs):
            self.need_buf(path, i, state, buf)

    def set(self, path: Path, i: Set, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_regs(path, i, state, i.value)
        state.regs.add(i.reg)

    def calc(self, path: Path, i: Calc, state: _State, counts: _Counts, mult: Count) -> None:
        if i.op not in CALC_OPS:
            self.problem(path, i, f"unknown operation {i.op!r}; use one of {', '.join(CALC_OPS)}")
        self.need_regs(path, i, state, i.lhs, i.rhs)
        state.regs.add(i.reg)

    def argmin(self, path: Path, i: ArgMin, state: _State, counts: _Counts, mult: Count) -> None:
        if not i.regs:
            self.problem(path, i, "argmin names no register; give it at least one")
        self.need_regs(path, i, state, *i.regs, *(() if i.add is None else (i.add,)))
        state.regs.add(i.reg)

    def read_value(
        self, path: Path, i: ReadValue, state: _State, counts: _Counts, mult: Count
    ) -> None:
        self.need_buf(path, i, state, i.buf)
        state.regs.add(i.reg)

    def write_value(
        self, path: Path, i: WriteValue, state: _State, counts: _Counts, mult: Count
    ) -> None:
        self.need_buf(path, i, state, i.buf)
        self.need_regs(path, i, state, i.value)

    def barrier(self, path: Path, i: Barrier, state: _State, counts: _Counts, mult: Count) -> None:
        members = self.barriers.get(i.group)
        if members is None:
            known = ", ".join(sorted(self.barriers)) or "none"
            self.problem(
                path, i, f"barrier group {i.group!r} is not declared (declared groups: {known})"
            )
        elif self.core not in members:
            self.problem(
                path,
                i,
                f"core {self.core} is not a member of barrier group {i.group!r} (cores "
                f"{list(members)}); add it to the group or remove this barrier",
            )
        counts.barriers[i.group] = _add(counts.barriers.get(i.group, 0), mult)

    def loop(self, path: Path, i: Loop, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_regs(path, i, state, i.count)
        n: Count = i.count if isinstance(i.count, int) else None
        if n is not None and n < 0:
            self.problem(path, i, f"loop count {n} is negative")
        inner = state.copy()
        if i.var:
            inner.regs.add(i.var)
        before = set(inner.live)
        self.walk(i.body, path, inner, counts, _mul(mult, n))
        if set(inner.live) != before and n != 1:
            added = sorted(set(inner.live) - before)
            freed = sorted(before - set(inner.live))
            self.problem(
                path,
                i,
                f"the loop body changes the allocated buffers (allocated and not freed: "
                f"{added}; freed: {freed}), so a second iteration would fail; free what the body "
                "allocates before its end, or allocate outside the loop",
            )
        state.live = inner.live
        if n is not None and n >= 1:
            state.regs |= inner.regs - ({i.var} if i.var else set())

    def if_(self, path: Path, i: If, state: _State, counts: _Counts, mult: Count) -> None:
        self.need_regs(path, i, state, i.cond.lhs, i.cond.rhs)
        then_state, else_state = state.copy(), state.copy()
        then_counts, else_counts = _Counts(), _Counts()
        self.walk(i.then, path, then_state, then_counts, mult)
        self.walk(i.orelse, path, else_state, else_counts, mult)
        counts.merge_branches(then_counts, else_counts)
        if set(then_state.live) != set(else_state.live):
            self.problem(
                path,
                i,
                f"the two arms leave different buffers allocated (then: "
                f"{sorted(then_state.live)}, else: {sorted(else_state.live)}); allocate and free "
                "the same buffers in both arms",
            )
        state.live = then_state.live
        state.regs = then_state.regs & else_state.regs

    def walk(
        self, body: tuple[Instr, ...], path: Path, state: _State, counts: _Counts, mult: Count
    ) -> None:
        for n, instr in enumerate(body, start=1):
            rule = _RULES.get(type(instr))
            if rule is None:
                where = ".".join(str(p) for p in (*path, n))
                self.problems.append(
                    f"core {self.core}, instr {where}: {instr!r} is not an instruction of "
                    "lowering.isa"
                )
                continue
            rule(self, (*path, n), instr, state, counts, mult)

    def run(self) -> CoreAnalysis:
        counts = _Counts()
        self.walk(self.program.body, (), _State(_Live(), set()), counts, 1)
        self.settle_peak()
        return CoreAnalysis(
            core=self.core,
            peak_sram_bytes=self.peak,
            peak_buffers=self.peak_live,
            sends=counts.sends,
            recvs=counts.recvs,
            sent_bytes=counts.sent_bytes,
            barriers=counts.barriers,
            compute_dtypes=frozenset(self.dtypes),
        )


_RULES = {
    Alloc: _Walker.alloc,
    Free: _Walker.free,
    Load: _Walker.load,
    Store: _Walker.store,
    Send: _Walker.send,
    Recv: _Walker.recv,
    SendValue: _Walker.send_value,
    RecvValue: _Walker.recv_value,
    WaitAny: _Walker.wait_any,
    LoadValue: _Walker.load_value,
    Compute: _Walker.compute,
    Set: _Walker.set,
    Calc: _Walker.calc,
    ArgMin: _Walker.argmin,
    ReadValue: _Walker.read_value,
    WriteValue: _Walker.write_value,
    Loop: _Walker.loop,
    If: _Walker.if_,
    Barrier: _Walker.barrier,
}


def analyze_programs(ps: ProgramSet) -> ProgramAnalysis:
    """Walk every program of ``ps`` once; see :class:`ProgramAnalysis`."""
    problems: list[str] = []
    cores = tuple(_Walker(ps, p, problems).run() for p in ps.programs)
    return ProgramAnalysis(cores, tuple(problems))
