"""One core's program, interpreted on its rank (Cyclotron §9.1: each PE interprets its own
instruction list; here the instructions act on numpy arrays, MPI messages and MPI windows).

The meaning of every instruction is the simulator's functional mode (:mod:`runtime.ops`,
:mod:`runtime.ops_comm`, :mod:`runtime.ops_mem`): buffers hold arrays of their dtype's numpy type, a ``Load`` reads and
a ``Store`` writes HBM when it runs, a message carries the buffer as it is when the ``Send``
runs, ``Compute`` runs the registered kernel.  As on the chip, a ``Recv`` only posts the
receive (a nonblocking receive): the core goes on and waits at the first instruction that reads
or overwrites the buffer, so a program that shifts a block and computes meanwhile overlaps the
two here too.  The core is a generator that yields a *wait* (what it is blocked on, for the
deadlock report) when it cannot go on, or ``None`` after a kernel, to let the rank move
messages along.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from lowering.isa import (
    DTYPE_BYTES,
    Affine,
    Alloc,
    ArgMin,
    Barrier,
    Calc,
    Compute,
    Free,
    If,
    Instr,
    Load,
    LoadValue,
    Loop,
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
from runtime.checks import describe
from runtime.layout import numpy_dtype
from runtime.mpi.errors import MpiError
from runtime.mpi.net import Payload, Post
from runtime.ops import CMP
from runtime.ops_control import CALC
from runtime.ops_pick import argmin

__all__ = ["CoreRun", "Buf"]

#: What a blocked core waits on: ("buf", buffer, channel), ("value", channel),
#: ("credit", channel, destination core), ("barrier", group).
Wait = tuple
Steps = Generator[Wait | None, None, None]


class Buf:
    """An SRAM buffer: its array (``None`` before ``Alloc``) and the receive pending into it."""

    __slots__ = ("name", "data", "dtype", "cap", "alloc_shape", "nbytes", "post", "chan")

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: np.ndarray | None = None
        self.dtype = ""
        self.cap = 0
        self.alloc_shape: tuple[int, ...] = ()
        self.nbytes = 0
        self.post: Post | None = None
        self.chan = ""


class CoreRun:
    """The state and instruction stream of one core on a rank (``ctx`` is the rank)."""

    def __init__(self, ctx: Any, core: int, body: tuple[Instr, ...]) -> None:
        self.ctx = ctx
        self.id = core
        self.body = body
        self.bufs: dict[str, Buf] = {}
        self.regs: dict[str, int] = {}
        self.sram = 0
        self.ins: Instr | None = None  # the instruction being executed (None: end of program)
        self.done = False
        self.steps = self._main()

    # -- helpers ------------------------------------------------------------------------------
    def error(self, msg: str) -> MpiError:
        """An error naming this core, its rank and instruction."""
        return MpiError(f"core {self.id} on rank {self.ctx.rank}, `{describe(self.ins)}`: {msg}")

    def value(self, v: int | str | Affine) -> int:
        try:
            if isinstance(v, int):
                return v
            if isinstance(v, str):
                return self.regs[v]
            return v.eval(self.regs)
        except KeyError as exc:
            raise self.error(f"register {exc.args[0]!r} is read before it is set") from None

    def buf(self, name: str) -> Buf:
        b = self.bufs.get(name)
        if b is None:
            b = self.bufs[name] = Buf(name)
        return b

    def allocated(self, name: str) -> Buf:
        b = self.buf(name)
        if b.data is None:
            raise self.error(
                f"buffer {name!r} is used before Alloc (or after Free); allocate it first"
            )
        return b

    def settle(self, b: Buf) -> Steps:
        """Wait until the receive pending into ``b`` (if any) has delivered."""
        while b.post is not None and not b.post.done:
            yield ("buf", b.name, b.chan)
        b.post = None

    def region(self, name: str, region: Region | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = self.ctx.decl_shape(name)
        if shape is None:
            raise self.error(f"tensor {name!r} is not declared; add a TensorDecl")
        if region is None:
            return (0,) * len(shape), shape
        starts = tuple(self.value(s) for s in region.starts)
        extents = tuple(self.value(e) for e in region.extents)
        if len(starts) != len(shape) or any(
            s < 0 or e < 0 or s + e > d for s, e, d in zip(starts, extents, shape)
        ):
            raise self.error(
                f"region starts={starts} extents={extents} is outside tensor {name!r} of shape "
                f"{shape}"
            )
        return starts, extents

    # -- the instruction stream ---------------------------------------------------------------
    def _main(self) -> Steps:
        yield from self._block(self.body)
        self.ins = None
        for b in self.bufs.values():  # the end of a program waits for its receives
            yield from self.settle(b)
        self.done = True

    def _block(self, body: tuple[Instr, ...]) -> Steps:
        for ins in body:
            self.ins = ins
            yield from _EXEC[type(ins)](self, ins)
            self.ctx.progress += 1

    def fill(self, post: Post, payload: Payload) -> None:
        """Complete receive ``post`` with ``payload`` (checks as the simulator's)."""
        b = post.buf
        name = b.chan if b is not None else "?"
        if b is None:
            if payload[0] != "v":
                raise self.error("the channel carried a tensor, not a control value; use Recv")
            post.value = int(payload[1])
            return
        if payload[0] != "d":
            raise self.error(
                f"channel {name!r} carried a control value, not a tensor; use RecvValue"
            )
        _, data, dtype = payload
        if dtype != b.dtype:
            raise self.error(
                f"channel {name!r} carried {dtype} data into {b.dtype} buffer {b.name!r}"
            )
        if data.size > b.cap:
            raise self.error(
                f"a {list(data.shape)} message on {name!r} does not fit buffer {b.name!r} "
                f"(capacity {list(b.alloc_shape)})"
            )
        b.data = data


def _alloc(c: CoreRun, i: Alloc) -> Steps:
    b = c.buf(i.buf)
    if b.data is not None:
        raise c.error(f"buffer {i.buf!r} is already allocated; Free it first or use another name")
    if i.dtype not in DTYPE_BYTES:
        raise c.error(f"unknown dtype {i.dtype!r}; use one of {', '.join(sorted(DTYPE_BYTES))}")
    b.nbytes = math.prod(i.shape) * DTYPE_BYTES[i.dtype]
    c.sram += b.nbytes
    limit = c.ctx.sram_bytes
    if limit is not None and c.sram > limit:
        raise c.error(
            f"SRAM overflow: {c.sram} bytes allocated, the core has {limit}; free buffers "
            "earlier or use smaller tiles"
        )
    b.data = np.zeros(i.shape, numpy_dtype(i.dtype))
    b.dtype, b.alloc_shape, b.cap = i.dtype, tuple(i.shape), math.prod(i.shape)
    yield from ()


def _free(c: CoreRun, i: Free) -> Steps:
    b = c.allocated(i.buf)
    yield from c.settle(b)
    b.data = None
    c.sram -= b.nbytes


def _load(c: CoreRun, i: Load) -> Steps:
    b = c.allocated(i.dst)
    yield from c.settle(b)
    region = c.region(i.tensor, i.region)
    extents = region[1]
    if math.prod(extents) > b.cap:
        raise c.error(
            f"{list(extents)} elements of {i.tensor!r} do not fit buffer {b.name!r} (capacity "
            f"{list(b.alloc_shape)})"
        )
    dtype = c.ctx.decl_dtype(i.tensor)
    if dtype != b.dtype:
        raise c.error(
            f"tensor {i.tensor!r} is {dtype} but buffer {b.name!r} is {b.dtype}; allocate the "
            f"buffer as {dtype}"
        )
    b.data = np.asarray(c.ctx.hbm.read(i.tensor, region), dtype=numpy_dtype(b.dtype))
    c.ctx.hbm_read += math.prod(extents) * DTYPE_BYTES[dtype]


def _store(c: CoreRun, i: Store) -> Steps:
    b = c.allocated(i.src)
    yield from c.settle(b)
    region = c.region(i.tensor, i.region)
    assert b.data is not None
    if tuple(b.data.shape) != tuple(region[1]):
        raise c.error(
            f"buffer {b.name!r} holds shape {list(b.data.shape)} but the region of "
            f"{i.tensor!r} is {list(region[1])}; store a matching region"
        )
    dtype = c.ctx.decl_dtype(i.tensor)
    if dtype != b.dtype:
        raise c.error(f"buffer {b.name!r} is {b.dtype} but tensor {i.tensor!r} is {dtype}")
    c.ctx.hbm.write(i.tensor, region, b.data, i.accumulate)
    c.ctx.hbm_write += b.data.size * DTYPE_BYTES[dtype]


def _channel(c: CoreRun, name: str, send: bool) -> None:
    ch = c.ctx.net.chans.get(name)
    if ch is None:
        raise c.error(
            f"channel {name!r} is not declared in the program set; declare a Channel for it"
        )
    if send and ch.src != c.id:
        raise c.error(f"channel {name!r} is sent by core {ch.src}, not core {c.id}")
    if not send and c.id not in ch.dsts:
        raise c.error(f"channel {name!r} delivers to cores {ch.dsts}, not core {c.id}")


def _wait_credit(c: CoreRun, channel: str) -> Steps:
    _channel(c, channel, True)
    net = c.ctx.net
    while True:
        dst = net.full(channel)
        if dst is None:
            return
        yield ("credit", channel, dst)


def _send(c: CoreRun, i: Send) -> Steps:
    b = c.allocated(i.src)
    yield from c.settle(b)
    yield from _wait_credit(c, i.channel)
    c.ctx.net.send(i.channel, ("d", b.data, b.dtype))


def _send_value(c: CoreRun, i: SendValue) -> Steps:
    v = c.value(i.value)
    yield from _wait_credit(c, i.channel)
    # the stream's stop token: a control value marked for a RecvValue with stop
    c.ctx.net.send(i.channel, ("v", v, "stop") if i.stop else ("v", v))


def _recv(c: CoreRun, i: Recv) -> Steps:
    b = c.allocated(i.dst)
    yield from c.settle(b)
    _channel(c, i.channel, False)
    post = Post(c.id, b, c.fill if i.stop is None else _fill_or_stop(c))
    b.post, b.chan = post, i.channel
    c.ctx.net.post(i.channel, c.id, post)
    if i.stop is not None:  # a tensor or the stream's stop token: the program branches on it
        while not post.done:
            yield ("value", i.channel)
        c.regs[i.stop] = post.value


def _fill_or_stop(c: CoreRun) -> Callable[[Post, Payload], None]:
    """The fill of a ``Recv`` with ``stop``: a control value is the stop token (its value),
    a tensor fills the buffer (value -1)."""

    def fill(post: Post, payload: Payload) -> None:
        if payload[0] == "v":
            post.value = int(payload[1])
            return
        c.fill(post, payload)
        post.value = -1

    return fill


def _recv_value(c: CoreRun, i: RecvValue) -> Steps:
    _channel(c, i.channel, False)
    token: list[bool] = []

    def fill(post: Post, payload: Payload) -> None:
        token.append(len(payload) == 3)  # the stream's stop token (a SendValue with stop)
        c.fill(post, payload)

    post = Post(c.id, None, c.fill if i.stop is None else fill)
    c.ctx.net.post(i.channel, c.id, post)
    while not post.done:
        yield ("value", i.channel)
    if i.stop is None:
        c.regs[i.reg] = post.value
    elif token[0]:  # ``reg`` unchanged
        c.regs[i.stop] = post.value
    else:
        c.regs[i.reg], c.regs[i.stop] = post.value, -1


def _load_value(c: CoreRun, i: LoadValue) -> Steps:
    shape = c.ctx.decl_shape(i.tensor)
    idx = tuple(c.value(x) for x in i.index)
    if shape is None or len(idx) != len(shape) or any(not 0 <= x < d for x, d in zip(idx, shape)):
        raise c.error(f"index {idx} is outside tensor {i.tensor!r} of shape {shape}")
    c.regs[i.reg] = c.ctx.hbm.value(i.tensor, idx)
    c.ctx.hbm_read += DTYPE_BYTES[c.ctx.decl_dtype(i.tensor)]
    yield from ()


def _compute(c: CoreRun, i: Compute) -> Steps:
    ins = [c.allocated(n) for n in i.ins]
    outs = [c.allocated(n) for n in i.outs]
    for b in ins + outs:
        yield from c.settle(b)
    kernel = get_kernel(i.kernel)
    t0 = time.perf_counter()
    try:
        res = kernel.run([b.data for b in ins], dict(i.params))
    except (KeyError, ValueError, IndexError) as exc:
        raise c.error(
            f"kernel {i.kernel!r} rejects input shapes {[list(b.data.shape) for b in ins]}: {exc}"  # type: ignore[union-attr]
        ) from None
    c.ctx.compute_s += time.perf_counter() - t0
    if len(res) != len(outs):
        raise c.error(
            f"kernel {i.kernel!r} makes {len(res)} outputs, the instruction names {len(outs)}"
        )
    for b, arr in zip(outs, res):
        data = np.asarray(arr, dtype=numpy_dtype(b.dtype))
        if data.size > b.cap:
            raise c.error(
                f"output {list(data.shape)} does not fit buffer {b.name!r} (capacity "
                f"{list(b.alloc_shape)}); allocate it larger"
            )
        b.data = data
    yield None  # let the rank move messages along between kernels


def _set(c: CoreRun, i: Set) -> Steps:
    c.regs[i.reg] = c.value(i.value)
    yield from ()


def _argmin(c: CoreRun, i: ArgMin) -> Steps:
    loads = [c.value(r) for r in i.regs]
    k = argmin(loads)
    if i.add is not None:
        c.regs[i.regs[k]] = loads[k] + c.value(i.add)
    c.regs[i.reg] = k
    yield from ()


def _calc(c: CoreRun, i: Calc) -> Steps:
    f = CALC.get(i.op)
    if f is None:
        raise c.error(f"unknown operation {i.op!r}; use one of {' '.join(CALC)}")
    c.regs[i.reg] = f(c.value(i.lhs), c.value(i.rhs))
    yield from ()


def _read_value(c: CoreRun, i: ReadValue) -> Steps:
    b = c.allocated(i.buf)
    yield from c.settle(b)
    assert b.data is not None
    flat = b.data.reshape(-1)
    if not 0 <= i.index < flat.size:
        raise c.error(f"element {i.index} is outside buffer {b.name!r} of {flat.size}")
    c.regs[i.reg] = int(flat[i.index])


def _write_value(c: CoreRun, i: WriteValue) -> Steps:
    b = c.allocated(i.buf)
    yield from c.settle(b)
    assert b.data is not None
    data = b.data.copy()  # a message sent from the buffer keeps the values it had
    flat = data.reshape(-1)
    if not 0 <= i.index < flat.size:
        raise c.error(f"element {i.index} is outside buffer {b.name!r} of {flat.size}")
    flat[i.index] = c.value(i.value)
    b.data = data


def _loop(c: CoreRun, i: Loop) -> Steps:
    for n in range(c.value(i.count)):
        if i.var:
            c.regs[i.var] = n
        yield from c._block(i.body)
        c.ins = i


def _if(c: CoreRun, i: If) -> Steps:
    cmp = CMP.get(i.cond.op)
    if cmp is None:
        raise c.error(f"unknown comparison {i.cond.op!r}; use one of {' '.join(CMP)}")
    taken = cmp(c.value(i.cond.lhs), c.value(i.cond.rhs))
    yield from c._block(i.then if taken else i.orelse)


def _wait_any(c: CoreRun, i: WaitAny) -> Steps:
    """The lowest index of ``i.channels`` whose next message (one no posted receive of this
    core takes) has come to this rank; arrival order here is the ranks' wall clock."""
    for name in i.channels:
        _channel(c, name, False)
    ends = [c.ctx.net.ends[(name, c.id)] for name in i.channels]
    while True:
        for k, end in enumerate(ends):
            if len(end.queue) > len(end.posts):
                c.regs[i.reg] = k
                return
        yield ("any", i.channels)


def _barrier(c: CoreRun, i: Barrier) -> Steps:
    group = c.ctx.barrier(i.group, c.id)
    gen = group.arrive(c.id)
    while group.gen == gen:
        yield ("barrier", i.group)


_EXEC: dict[type, Callable[[CoreRun, Any], Steps]] = {
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
