"""A builder for per-core programs: one instruction list per core, loops and branches as
context managers, channel / tensor / barrier declarations, a frozen :class:`ProgramSet` at the end.

    b = ProgramBuilder("copy")
    b.tensor("X", (4, 4), "fp32")
    b.channel("x", src=0, dsts=1)
    with b.core(0) as p:
        p.alloc("t", (4, 4), "fp32")
        p.load("t", "X")
        with p.loop(3, var="i"):
            p.send("x", "t")
    ps = b.build()

The builder only assembles; :func:`lowering.validate_programs` checks a program set against a chip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from types import TracebackType

from lowering.errors import ProgramError
from lowering.isa import (
    Affine,
    Alloc,
    Barrier,
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
    Program,
    ProgramSet,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
    Store,
    TensorDecl,
)

__all__ = ["ProgramBuilder", "CoreBuilder", "RecordingBuilder", "region", "affine"]


def region(starts: Sequence[Index], extents: Sequence[Index]) -> Region:
    """A :class:`Region` from per-dimension starts and extents."""
    if len(starts) != len(extents):
        raise ProgramError(
            f"region: {len(starts)} starts but {len(extents)} extents; give one of each per "
            "dimension"
        )
    return Region(tuple(starts), tuple(extents))


def affine(const: int = 0, **coefs: int) -> Affine:
    """``const + sum(coef * reg)``: ``affine(2, t=4)`` is ``4*t + 2``."""
    return Affine(const, tuple((name, coef) for name, coef in coefs.items() if coef != 0))


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


class CoreBuilder:
    """Instructions of one core.  Methods append one instruction and return the builder;
    :meth:`loop`, :meth:`if_` and :meth:`else_` are context managers that collect a body."""

    def __init__(self, core: int, pool: dict[tuple, Instr] | None = None) -> None:
        self.core = core
        self._stack: list[list[Instr]] = [[]]
        self._labels: list[str] = []
        self._pool = pool

    # -- context-manager use: ``with builder.core(3) as p: ...`` ------------------------------
    def __enter__(self) -> CoreBuilder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._check_closed()

    def _check_closed(self) -> None:
        if len(self._stack) != 1:
            raise ProgramError(
                f"core {self.core}: {self._labels[-1]} block is still open; close it "
                "(leave its `with` block) before finishing the program"
            )

    def emit(self, instr: Instr) -> CoreBuilder:
        """Append any instruction (the typed helpers below call this)."""
        self._stack[-1].append(instr)
        return self

    def _shared(self, key: tuple, make: Callable[[], Instr]) -> CoreBuilder:
        """Append the instruction ``make()`` whose fields are ``key``: with a shared pool
        (:class:`ProgramBuilder` ``share=True``) the object an earlier equal call made."""
        pool = self._pool
        if pool is None:
            self._stack[-1].append(make())
            return self
        instr = pool.get(key)
        if instr is None:
            instr = pool[key] = make()
        self._stack[-1].append(instr)
        return self

    def extend(self, instrs: Sequence[Instr]) -> CoreBuilder:
        """Append instructions built elsewhere (:mod:`lowering.elk_layers` copies a layer's)."""
        self._stack[-1].extend(instrs)
        return self

    def size(self) -> int:
        """Instructions in the block being emitted."""
        return len(self._stack[-1])

    def emitted(self, start: int) -> list[Instr]:
        """The instructions of the current block from position ``start`` on."""
        return self._stack[-1][start:]

    def body(self) -> tuple[Instr, ...]:
        """The finished instruction list."""
        self._check_closed()
        return tuple(self._stack[0])

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, buf: str, shape: Sequence[int], dtype: str = "bf16") -> CoreBuilder:
        """Reserve SRAM buffer ``buf`` of capacity ``shape`` x ``dtype``."""
        shp = tuple(shape)
        pool = self._pool
        if pool is None:
            return self.emit(Alloc(buf, shp, dtype))
        key = (Alloc, buf, shp, dtype)
        instr = pool.get(key)
        if instr is None:
            instr = pool[key] = Alloc(buf, shp, dtype)
        self._stack[-1].append(instr)
        return self

    def free(self, buf: str) -> CoreBuilder:
        """Release SRAM buffer ``buf``."""
        pool = self._pool
        if pool is None:
            return self.emit(Free(buf))
        key = (Free, buf)
        instr = pool.get(key)
        if instr is None:
            instr = pool[key] = Free(buf)
        self._stack[-1].append(instr)
        return self

    def load(
        self, dst: str, tensor: str, region: Region | None = None, background: bool = False
    ) -> CoreBuilder:
        """HBM ``tensor`` (or its ``region``) -> buffer ``dst``; ``background``: a preload
        read served behind execute traffic (:class:`lowering.isa.Load`)."""
        return self.emit(Load(dst, tensor, region, background))

    def store(
        self, src: str, tensor: str, region: Region | None = None, accumulate: bool = False
    ) -> CoreBuilder:
        """Buffer ``src`` -> HBM ``tensor`` (or its ``region``); ``accumulate`` adds."""
        return self.emit(Store(src, tensor, region, accumulate))

    # -- communication -------------------------------------------------------------------------
    def send(self, channel: str, src: str) -> CoreBuilder:
        """Send buffer ``src`` on ``channel``."""
        return self.emit(Send(channel, src))

    def recv(self, channel: str, dst: str) -> CoreBuilder:
        """Receive one message of ``channel`` into buffer ``dst``."""
        return self._shared((Recv, channel, dst), lambda: Recv(channel, dst))

    def send_value(self, channel: str, value: Operand | Affine) -> CoreBuilder:
        """Send a control value on ``channel``."""
        return self.emit(SendValue(channel, value))

    def recv_value(self, channel: str, reg: str) -> CoreBuilder:
        """Receive a control value of ``channel`` into register ``reg``."""
        return self._shared((RecvValue, channel, reg), lambda: RecvValue(channel, reg))

    def load_value(self, reg: str, tensor: str, index: Sequence[Index]) -> CoreBuilder:
        """Register ``reg`` = integer element ``tensor[index]``."""
        return self.emit(LoadValue(reg, tensor, tuple(index)))

    # -- compute and control -------------------------------------------------------------------
    def compute(
        self,
        kernel: str,
        outs: str | Sequence[str],
        ins: str | Sequence[str] = (),
        params: dict[str, int | float | str] | None = None,
        dtype: str = "bf16",
    ) -> CoreBuilder:
        """Run ``kernel`` on buffers ``ins`` into ``outs``; ``params`` are stored sorted."""
        items = tuple(sorted((params or {}).items()))
        o, i = _names(outs), _names(ins)
        if self._pool is None:
            return self.emit(Compute(kernel, o, i, items, dtype))
        key = (Compute, kernel, o, i, items, dtype)
        try:
            hash(key)
        except TypeError:  # an unhashable parameter value: not shared
            return self.emit(Compute(kernel, o, i, items, dtype))
        return self._shared(key, lambda: Compute(kernel, o, i, items, dtype))

    def set(self, reg: str, value: Operand | Affine) -> CoreBuilder:
        """Register ``reg`` = ``value``."""
        return self.emit(Set(reg, value))

    def barrier(self, group: str) -> CoreBuilder:
        """Wait for every core of barrier group ``group``."""
        return self.emit(Barrier(group))

    @contextmanager
    def loop(self, count: Operand | Affine, var: str | None = None) -> Iterator[CoreBuilder]:
        """``with p.loop(n, var="i"):`` — the body is what is emitted inside the block."""
        self._stack.append([])
        self._labels.append(f"loop {count!r}")
        try:
            yield self
        except BaseException:
            self._stack.pop()
            self._labels.pop()
            raise
        body = self._stack.pop()
        self._labels.pop()
        self.emit(Loop(count, tuple(body), var))

    @contextmanager
    def if_(self, lhs: Operand | Affine, op: str, rhs: Operand | Affine) -> Iterator[CoreBuilder]:
        """``with p.if_("n", ">", 0):`` — then-branch; an :meth:`else_` block may follow."""
        cond = Cond(lhs, op, rhs)  # type: ignore[arg-type]
        self._stack.append([])
        self._labels.append("if")
        try:
            yield self
        except BaseException:
            self._stack.pop()
            self._labels.pop()
            raise
        body = self._stack.pop()
        self._labels.pop()
        self.emit(If(cond, tuple(body)))

    @contextmanager
    def else_(self) -> Iterator[CoreBuilder]:
        """The else-branch of the :class:`If` emitted just before."""
        current = self._stack[-1]
        if not current or not isinstance(current[-1], If) or current[-1].orelse:
            raise ProgramError(
                f"core {self.core}: else_() must directly follow an if_() block without an else"
            )
        self._stack.append([])
        self._labels.append("else")
        try:
            yield self
        except BaseException:
            self._stack.pop()
            self._labels.pop()
            raise
        body = self._stack.pop()
        self._labels.pop()
        last = current.pop()
        assert isinstance(last, If)
        current.append(If(last.cond, last.then, tuple(body)))


class ProgramBuilder:
    """Collects per-core programs and the channels, tensors and barrier groups they share.

    ``share=True``: equal ``Alloc``, ``Free``, ``Compute``, ``Recv`` and ``RecvValue``
    instructions of any cores are one object (instructions are frozen values, so this changes
    nothing but memory: a chip of a thousand cores running the same tile program holds each of
    them once)."""

    def __init__(self, name: str = "program", *, share: bool = False) -> None:
        self.name = name
        self._pool: dict[tuple, Instr] | None = {} if share else None
        self._cores: dict[int, CoreBuilder] = {}
        self._channels: dict[str, Channel] = {}
        self._tensors: dict[str, TensorDecl] = {}
        self._barriers: dict[str, tuple[int, ...]] = {}
        self._meta: dict[str, str] = {}

    def tensor(self, name: str, shape: Sequence[int], dtype: str = "bf16") -> str:
        """Declare HBM tensor ``name``; returns the name."""
        if name in self._tensors:
            raise ProgramError(f"tensor {name!r} is declared twice; declare each tensor once")
        self._tensors[name] = TensorDecl(name, tuple(shape), dtype)
        return name

    def channel(
        self, name: str, src: int, dsts: int | Sequence[int], depth: int | None = None
    ) -> str:
        """Declare channel ``name`` from core ``src`` to ``dsts`` (several: multicast)."""
        if name in self._channels:
            raise ProgramError(f"channel {name!r} is declared twice; declare each channel once")
        targets = (dsts,) if isinstance(dsts, int) else tuple(dsts)
        self._channels[name] = Channel(name, src, targets, depth)
        return name

    def has_channel(self, name: str) -> bool:
        """Whether channel ``name`` is declared."""
        return name in self._channels

    def declared(self, name: str) -> Channel:
        """The declaration of channel ``name``."""
        return self._channels[name]

    def channel_count(self) -> int:
        """Channels declared so far."""
        return len(self._channels)

    def channels_since(self, count: int) -> list[str]:
        """Names of the channels declared after the first ``count``, in declaration order."""
        extra = len(self._channels) - count
        return list(islice(reversed(self._channels), extra))[::-1] if extra > 0 else []

    def barrier_group(self, name: str, cores: Sequence[int]) -> str:
        """Declare barrier group ``name`` of ``cores``."""
        if name in self._barriers:
            raise ProgramError(f"barrier group {name!r} is declared twice")
        self._barriers[name] = tuple(cores)
        return name

    def meta(self, key: str, value: object) -> None:
        """Attach a ``key = value`` note (kept as text) to the program set."""
        self._meta[key] = str(value)

    def core(self, core: int) -> CoreBuilder:
        """The builder of ``core``'s program (created on first use)."""
        if core not in self._cores:
            self._cores[core] = CoreBuilder(core, self._pool)
        return self._cores[core]

    def build(self) -> ProgramSet:
        """The frozen program set: programs sorted by core, declarations in order."""
        programs = tuple(Program(c, self._cores[c].body()) for c in sorted(self._cores))
        return ProgramSet(
            programs=programs,
            channels=tuple(self._channels.values()),
            tensors=tuple(self._tensors.values()),
            barriers=tuple(self._barriers.items()),
            name=self.name,
            meta=tuple(self._meta.items()),
        )


class _DiscardingCore(CoreBuilder):
    """A :class:`CoreBuilder` that keeps no instructions (see :class:`RecordingBuilder`)."""

    def emit(self, instr: Instr) -> CoreBuilder:
        return self

    def alloc(self, buf: str, shape: Sequence[int], dtype: str = "bf16") -> CoreBuilder:
        return self

    def free(self, buf: str) -> CoreBuilder:
        return self

    def load(
        self, dst: str, tensor: str, region: Region | None = None, background: bool = False
    ) -> CoreBuilder:
        return self

    def store(
        self, src: str, tensor: str, region: Region | None = None, accumulate: bool = False
    ) -> CoreBuilder:
        return self

    def send(self, channel: str, src: str) -> CoreBuilder:
        return self

    def recv(self, channel: str, dst: str) -> CoreBuilder:
        return self

    def send_value(self, channel: str, value: Operand | Affine) -> CoreBuilder:
        return self

    def recv_value(self, channel: str, reg: str) -> CoreBuilder:
        return self

    def compute(
        self,
        kernel: str,
        outs: str | Sequence[str],
        ins: str | Sequence[str] = (),
        params: dict[str, int | float | str] | None = None,
        dtype: str = "bf16",
    ) -> CoreBuilder:
        return self

    def extend(self, instrs: Sequence[Instr]) -> CoreBuilder:
        return self


class RecordingBuilder(ProgramBuilder):
    """A :class:`ProgramBuilder` for a pass whose instructions are thrown away: an emitter run
    once only for what it tells a helper on the side (the activation loads and stores that
    :class:`lowering.elk_flow.Flow` records before it plans the transfers).  Instructions are
    not built; channel names are remembered (so :meth:`has_channel` answers as it would),
    nothing else is kept, and :meth:`build` is not available."""

    def __init__(self, name: str = "program") -> None:
        super().__init__(name)
        self._names: set[str] = set()

    def tensor(self, name: str, shape: Sequence[int], dtype: str = "bf16") -> str:
        return name

    def channel(
        self, name: str, src: int, dsts: int | Sequence[int], depth: int | None = None
    ) -> str:
        self._names.add(name)
        return name

    def has_channel(self, name: str) -> bool:
        return name in self._names

    def core(self, core: int) -> CoreBuilder:
        if core not in self._cores:
            self._cores[core] = _DiscardingCore(core)
        return self._cores[core]

    def build(self) -> ProgramSet:
        raise ProgramError(f"{self.name}: a RecordingBuilder keeps no instructions to build")
