"""Reference semantics of per-core programs: a small functional interpreter without timing.

It defines what each instruction means on real data (one function per instruction kind in
:data:`_EXEC`), so the simulator's functional mode and the program generators can be checked
against it.  Cores run as coroutines in a fixed round-robin order; channels are per-destination
FIFOs of ``depth`` messages (``Channel.depth`` or ``fifo_depth``); a send copies the buffer and
delivers one copy to every destination (multicast).  When no core can make progress before all
have finished, the run stops with a :class:`ProgramError` listing who waits on what (deadlock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field

import numpy as np

from lowering.errors import ProgramError
from lowering.isa import (
    CALC_FNS,
    Affine,
    Alloc,
    ArgMin,
    Barrier,
    Calc,
    Channel,
    Compute,
    Cond,
    Free,
    If,
    Index,
    Instr,
    Load,
    LoadValue,
    Loop,
    Operand,
    ProgramSet,
    ReadValue,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
    Store,
    WaitAny,
    WriteValue,
)
from lowering.kernels import get_kernel
from lowering.printer import format_instr

__all__ = ["run_reference"]

_INT_DTYPES = {"int8": np.int8, "int32": np.int32, "int64": np.int64, "bool": np.bool_}
_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "&": lambda a, b: (a & b) != 0,
}

Wait = Generator[str, None, None]


@dataclass(slots=True)
class _World:
    tensors: dict[str, np.ndarray]
    channels: dict[str, Channel]
    queues: dict[tuple[str, int], deque]  # (channel, dst) -> messages
    depth: Callable[[Channel], int]
    barrier_members: dict[str, tuple[int, ...]]
    barrier_arrived: dict[str, set[int]] = field(default_factory=dict)
    barrier_generation: dict[str, int] = field(default_factory=dict)
    progress: int = 0


@dataclass(slots=True)
class _Core:
    core: int
    world: _World
    bufs: dict[str, np.ndarray | None] = field(default_factory=dict)
    regs: dict[str, int] = field(default_factory=dict)

    def value(self, v: Operand | Affine | Index) -> int:
        if isinstance(v, int):
            return v
        if isinstance(v, str):
            return self.regs[v]
        return v.eval(self.regs)

    def slices(self, tensor: str, region: Region | None) -> tuple[slice, ...]:
        shape = self.world.tensors[tensor].shape
        if region is None:
            return tuple(slice(0, d) for d in shape)
        return tuple(
            slice(self.value(s), self.value(s) + self.value(e))
            for s, e in zip(region.starts, region.extents)
        )

    def buffer(self, name: str) -> np.ndarray:
        data = self.bufs.get(name)
        if data is None:
            raise ProgramError(f"core {self.core}: buffer {name!r} is read before it holds data")
        return data


def _alloc(c: _Core, i: Alloc) -> Wait:
    c.bufs[i.buf] = None
    yield from ()


def _free(c: _Core, i: Free) -> Wait:
    c.bufs.pop(i.buf, None)
    yield from ()


def _load(c: _Core, i: Load) -> Wait:
    c.bufs[i.dst] = c.world.tensors[i.tensor][c.slices(i.tensor, i.region)].copy()
    yield from ()


def _store(c: _Core, i: Store) -> Wait:
    view = c.slices(i.tensor, i.region)
    data = c.buffer(i.src)
    if i.accumulate:
        c.world.tensors[i.tensor][view] += data
    else:
        c.world.tensors[i.tensor][view] = data
    yield from ()


def _put(c: _Core, channel: str, message: object) -> Wait:
    ch = c.world.channels[channel]
    for dst in ch.dsts:
        q = c.world.queues[(channel, dst)]
        while len(q) >= c.world.depth(ch):
            yield f"send on {channel!r} (FIFO to core {dst} full)"
    for dst in ch.dsts:
        c.world.queues[(channel, dst)].append(message)


def _take(c: _Core, channel: str) -> Generator[str, None, object]:
    q = c.world.queues[(channel, c.core)]
    while not q:
        yield f"recv on {channel!r} (empty)"
    return q.popleft()


def _send(c: _Core, i: Send) -> Wait:
    yield from _put(c, i.channel, c.buffer(i.src).copy())


def _recv(c: _Core, i: Recv) -> Wait:
    msg = yield from _take(c, i.channel)
    if i.stop is not None:  # a tensor, or the stream's stop token (a control value)
        if not isinstance(msg, np.ndarray):
            c.regs[i.stop] = int(msg)  # type: ignore[call-overload]
            return
        c.regs[i.stop] = -1
    c.bufs[i.dst] = msg  # type: ignore[assignment]


class _Stop(int):
    """A stream's stop token on its way (a ``SendValue`` with ``stop``)."""


def _send_value(c: _Core, i: SendValue) -> Wait:
    v = c.value(i.value)
    yield from _put(c, i.channel, _Stop(v) if i.stop else v)


def _recv_value(c: _Core, i: RecvValue) -> Wait:
    msg = yield from _take(c, i.channel)
    if i.stop is None:
        c.regs[i.reg] = int(msg)  # type: ignore[call-overload]
    elif isinstance(msg, _Stop):  # the stream's stop token: ``reg`` unchanged
        c.regs[i.stop] = int(msg)
    else:
        c.regs[i.reg] = int(msg)  # type: ignore[call-overload]
        c.regs[i.stop] = -1


def _wait_any(c: _Core, i: WaitAny) -> Wait:
    """The lowest index of ``i.channels`` whose FIFO holds a message when the core looks (no
    timing here: the order the round-robin schedule delivered them)."""
    while True:
        for k, name in enumerate(i.channels):
            if c.world.queues[(name, c.core)]:
                c.regs[i.reg] = k
                return
        yield f"wait_any on {', '.join(i.channels)} (all empty)"


def _load_value(c: _Core, i: LoadValue) -> Wait:
    c.regs[i.reg] = int(c.world.tensors[i.tensor][tuple(c.value(x) for x in i.index)])
    yield from ()


def _compute(c: _Core, i: Compute) -> Wait:
    kernel = get_kernel(i.kernel)
    outs = kernel.run([c.buffer(b) for b in i.ins], dict(i.params))
    for name, data in zip(i.outs, outs):
        c.bufs[name] = np.asarray(data)
    yield from ()


def _set(c: _Core, i: Set) -> Wait:
    c.regs[i.reg] = c.value(i.value)
    yield from ()


def _calc(c: _Core, i: Calc) -> Wait:
    c.regs[i.reg] = CALC_FNS[i.op](c.value(i.lhs), c.value(i.rhs))
    yield from ()


def _argmin(c: _Core, i: ArgMin) -> Wait:
    loads = [c.regs[r] for r in i.regs]
    k = int(np.argmin(loads))  # ties to the lowest index
    if i.add is not None:
        c.regs[i.regs[k]] = loads[k] + c.value(i.add)
    c.regs[i.reg] = k
    yield from ()


def _read_value(c: _Core, i: ReadValue) -> Wait:
    c.regs[i.reg] = int(np.asarray(c.buffer(i.buf)).reshape(-1)[i.index])
    yield from ()


def _write_value(c: _Core, i: WriteValue) -> Wait:
    buf = np.array(c.buffer(i.buf))
    buf.reshape(-1)[i.index] = c.value(i.value)
    c.bufs[i.buf] = buf
    yield from ()


def _loop(c: _Core, i: Loop) -> Wait:
    for n in range(c.value(i.count)):
        if i.var:
            c.regs[i.var] = n
        yield from _run(c, i.body)


def _cond(c: _Core, cond: Cond) -> bool:
    return _COMPARE[cond.op](c.value(cond.lhs), c.value(cond.rhs))


def _if(c: _Core, i: If) -> Wait:
    yield from _run(c, i.then if _cond(c, i.cond) else i.orelse)


def _barrier(c: _Core, i: Barrier) -> Wait:
    w = c.world
    generation = w.barrier_generation.get(i.group, 0)
    arrived = w.barrier_arrived.setdefault(i.group, set())
    arrived.add(c.core)
    if len(arrived) == len(w.barrier_members[i.group]):
        w.barrier_arrived[i.group] = set()
        w.barrier_generation[i.group] = generation + 1
    while w.barrier_generation.get(i.group, 0) == generation:
        yield f"barrier {i.group!r}"


_EXEC: dict[type, Callable[..., Wait]] = {
    Alloc: _alloc,
    Free: _free,
    Load: _load,
    Store: _store,
    Send: _send,
    Recv: _recv,
    SendValue: _send_value,
    RecvValue: _recv_value,
    WaitAny: _wait_any,
    LoadValue: _load_value,
    Compute: _compute,
    Set: _set,
    Calc: _calc,
    ArgMin: _argmin,
    ReadValue: _read_value,
    WriteValue: _write_value,
    Loop: _loop,
    If: _if,
    Barrier: _barrier,
}


def _run(c: _Core, body: tuple[Instr, ...]) -> Wait:
    for instr in body:
        try:
            yield from _EXEC[type(instr)](c, instr)
        except (KeyError, IndexError, ValueError) as exc:
            if isinstance(exc, ProgramError):
                raise
            raise ProgramError(
                f"core {c.core} `{format_instr(instr)}` failed: {type(exc).__name__}: {exc}"
            ) from exc
        c.world.progress += 1


def run_reference(
    ps: ProgramSet, inputs: Mapping[str, np.ndarray], fifo_depth: int = 2
) -> dict[str, np.ndarray]:
    """Run ``ps`` on ``inputs`` (HBM tensors by name); return every declared tensor after the
    run.  Tensors not given start as zeros (float32, or their integer dtype)."""
    tensors: dict[str, np.ndarray] = {}
    for decl in ps.tensors:
        if decl.name in inputs:
            tensors[decl.name] = np.array(inputs[decl.name], copy=True)
        else:
            tensors[decl.name] = np.zeros(decl.shape, _INT_DTYPES.get(decl.dtype, np.float32))
    channels = {ch.name: ch for ch in ps.channels}
    world = _World(
        tensors=tensors,
        channels=channels,
        queues={(ch.name, d): deque() for ch in ps.channels for d in ch.dsts},
        depth=lambda ch: ch.depth if ch.depth is not None else fifo_depth,
        barrier_members=dict(ps.barriers),
    )
    running = {p.core: _run(_Core(p.core, world), p.body) for p in ps.programs}
    waiting: dict[int, str] = {}
    while running:
        before = world.progress
        for core in list(running):
            try:
                waiting[core] = next(running[core])
            except StopIteration:
                del running[core]
                waiting.pop(core, None)
        if running and world.progress == before:
            detail = "; ".join(f"core {c} waits for {waiting[c]}" for c in sorted(running))
            raise ProgramError(f"program set {ps.name!r} deadlocks: {detail}")
    return tensors
