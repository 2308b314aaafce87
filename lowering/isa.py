"""Per-core programs: the instruction set the simulator executes.

In the spirit of Cyclotron's per-PE programs (Cyclotron §6, §9): every core runs its own list of
instructions — loads from / stores to HBM, sends / receives on named channels, compute kernels,
loops and branches on *control values received at run time* (counts, selectors, stop tokens), so
one program serves every expert routing and every KV length.

Data lives in named SRAM buffers declared with :class:`Alloc` (shape = capacity; the shape a
buffer actually holds is set by whatever was loaded/received/computed into it, so a buffer can
hold a smaller, data-dependent tile).  Control values live in integer registers (plain names).
Channels are declared once per :class:`ProgramSet`; a channel has one sending core and one or
more receiving cores (multicast) and a FIFO depth in messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Affine",
    "Index",
    "Operand",
    "Region",
    "Alloc",
    "Free",
    "Load",
    "Store",
    "Send",
    "Recv",
    "SendValue",
    "RecvValue",
    "WaitAny",
    "LoadValue",
    "Compute",
    "Set",
    "Calc",
    "ArgMin",
    "ReadValue",
    "WriteValue",
    "CALC_OPS",
    "CALC_FNS",
    "Loop",
    "Cond",
    "If",
    "Barrier",
    "Instr",
    "walk",
    "Channel",
    "TensorDecl",
    "Program",
    "ProgramSet",
    "DTYPE_BYTES",
]

#: Bytes per element of each dtype name used in programs.
DTYPE_BYTES: Mapping[str, int] = {
    "bf16": 2,
    "fp16": 2,
    "fp32": 4,
    "int32": 4,
    "int64": 8,
    "int8": 1,
    "bool": 1,
}

#: An integer literal or the name of a register.
Operand = int | str


@dataclass(frozen=True, slots=True)
class Affine:
    """``const + sum(coef * reg)``: an address or count computed from registers at run time."""

    const: int = 0
    terms: tuple[tuple[str, int], ...] = ()

    def eval(self, regs: Mapping[str, int]) -> int:
        """Value under the register file ``regs``."""
        return self.const + sum(coef * regs[name] for name, coef in self.terms)


#: A start index: a literal, a register, or an affine expression of registers.
Index = int | str | Affine


@dataclass(frozen=True, slots=True)
class Region:
    """An n-d box of a tensor: per dimension a start (possibly run-time) and an extent.

    An extent may be an :data:`Index` too, so a load of a data-dependent number of rows (a KV
    cache of run-time length, the tokens routed to an expert) is one instruction."""

    starts: tuple[Index, ...]
    extents: tuple[Index, ...]


@dataclass(frozen=True, slots=True)
class Alloc:
    """Reserve an SRAM buffer of capacity ``shape`` x ``dtype`` (counted against ``sram_bytes``).

    ``held``: the buffer is allocated at a capacity bound for tiles whose size only the run
    knows (an expert's ``[n_e, H]`` tiles, dynamic tiling, STeP §5.2), and the core's on-chip
    account counts the most bytes it has held so far (its high-water mark, checked against
    ``sram_bytes`` as it grows), not its capacity: the memory a run uses, not the bound."""

    buf: str
    shape: tuple[int, ...]
    dtype: str = "bf16"
    held: bool = False


@dataclass(frozen=True, slots=True)
class Free:
    """Release an SRAM buffer."""

    buf: str


@dataclass(frozen=True, slots=True)
class Load:
    """HBM -> SRAM: read ``region`` of ``tensor`` (whole tensor when ``None``) into ``dst``.
    ``background``: the read is background traffic (an ELK ``preload_async`` piece, ELK §4.5):
    the core's network port serves it in the cycles execute traffic leaves free
    (:mod:`runtime.network`); ``False`` (default): ordinary traffic."""

    dst: str
    tensor: str
    region: Region | None = None
    background: bool = False


@dataclass(frozen=True, slots=True)
class Store:
    """SRAM -> HBM: write ``src`` into ``region`` of ``tensor`` (whole tensor when ``None``).
    ``accumulate`` adds into the destination instead of overwriting (a scatter-add)."""

    src: str
    tensor: str
    region: Region | None = None
    accumulate: bool = False


@dataclass(frozen=True, slots=True)
class Send:
    """Send the contents of buffer ``src`` on ``channel`` (blocks while the FIFO is full).

    The message is a copy of the buffer as it is when the send completes: the program may
    overwrite or receive into ``src`` right after (Cannon's shifts send a block, compute with it,
    then receive the next block into the same buffer).  On a multicast channel every
    destination gets the message."""

    channel: str
    src: str


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive one message from ``channel`` into buffer ``dst`` (blocks while empty); ``dst``
    then holds the message's data and shape (at most its allocated capacity).

    With ``stop`` (a register) the message may also be the stream's stop token, the control
    value a producer sends after a stream's last element (STeP §3.2.3: a Partition's output
    ends with one, carrying its count), and the receive waits for the message, as
    ``RecvValue`` does: ``stop`` is ``-1`` when data landed in ``dst``, else the token's
    value (``dst`` unchanged).  A loop over a stream whose length only the data knows
    receives until ``stop >= 0``."""

    channel: str
    dst: str
    stop: str | None = None


@dataclass(frozen=True, slots=True)
class SendValue:
    """Send a control value (count, selector bitmask, stop-token level) on ``channel``.

    ``stop``: the value is the stream's stop token (its value: the count, STeP §3.2.3), marked
    so that a ``RecvValue`` with ``stop`` tells it from a control value of the stream (a
    buffer reference, an address); a ``Recv`` with ``stop`` takes any value as the token."""

    channel: str
    value: Operand | Affine
    stop: bool = False


@dataclass(frozen=True, slots=True)
class RecvValue:
    """Receive a control value from ``channel`` into register ``reg``.

    With ``stop`` (a register) the message may also be the stream's stop token (a
    ``SendValue`` with ``stop``): ``stop`` is ``-1`` when a value landed in ``reg``, else the
    token's value (``reg`` unchanged) — a stream of buffer references or addresses whose
    length only the run knows, down to none."""

    channel: str
    reg: str
    stop: str | None = None


@dataclass(frozen=True, slots=True)
class WaitAny:
    """Wait until the next message of one of ``channels`` has arrived and write that channel's
    index (in ``channels``) into register ``reg``: the choice of an EagerMerge, "whichever
    input is ready" (STeP arXiv 2511.07776 §3.2.3, §5.3), made as the run proceeds.

    The message is not taken: the program receives it next (a ``Recv`` or ``RecvValue`` on the
    chosen channel, under ``If`` on ``reg``).  The simulator chooses the channel whose next
    message (the first no earlier receive of this core takes) arrived first in simulated time,
    ties by the lowest index, at the cycle it arrived (or at once when one is there); the
    untimed interpreters (reference, replay, MPI) take the lowest index holding a message when
    the core looks, so the choice there depends on their schedule, not on timing (the replay,
    given the order a timed run recorded, follows it: :attr:`runtime.replay.Replay.order`)."""

    channels: tuple[str, ...]
    reg: str


@dataclass(frozen=True, slots=True)
class LoadValue:
    """Read one integer element of an HBM tensor into register ``reg`` (a routing table entry, a
    request's KV length).  Integer tensors carry real values in timing mode too, so control flow
    is the same in both modes."""

    reg: str
    tensor: str
    index: tuple[Index, ...]


@dataclass(frozen=True, slots=True)
class Compute:
    """Run kernel ``kernel`` (see :mod:`lowering.kernels`) reading ``ins`` and writing ``outs``.

    ``params`` are the kernel's static parameters as sorted ``(name, value)`` pairs; ``dtype``
    selects the core's FLOPs/cycle.  A buffer may appear in both ``ins`` and ``outs``
    (accumulation)."""

    kernel: str
    outs: tuple[str, ...]
    ins: tuple[str, ...]
    params: tuple[tuple[str, int | float | str], ...] = ()
    dtype: str = "bf16"


@dataclass(frozen=True, slots=True)
class Set:
    """``reg = value`` (a literal, a register or an affine expression of registers)."""

    reg: str
    value: Operand | Affine


#: Integer operations of :class:`Calc` (what an ``Affine`` cannot express) and their meaning.
CALC_FNS: Mapping[str, Callable[[int, int], int]] = {
    "shl": lambda a, b: a << b,
    "floordiv": lambda a, b: a // b,
    "ceildiv": lambda a, b: -(-a // b),
    "mod": lambda a, b: a % b,
    "min": min,
    "max": max,
    "mul": lambda a, b: a * b,
}
CALC_OPS = tuple(CALC_FNS)


@dataclass(frozen=True, slots=True)
class Calc:
    """``reg = lhs op rhs`` on integers, ``op`` one of :data:`CALC_OPS` (a bit of a selector
    mask from an expert id, a tile count from a length): a control value computed from control
    values at run time, in zero cycles like :class:`Set`."""

    reg: str
    op: str
    lhs: Operand | Affine
    rhs: Operand | Affine


@dataclass(frozen=True, slots=True)
class ArgMin:
    """``reg = `` the index of the least of the registers ``regs`` (ties to the lowest index);
    with ``add``, that register then grows by ``add`` (evaluated before the instruction
    writes anything).  One step of greedy list scheduling in one instruction: the least
    loaded lane takes the next item (STeP arXiv 2511.07776 §5.4, decode attention's lanes),
    as a chain of ``If`` on ``<`` and ``==`` computes it.  A register operation: zero cycles,
    like :class:`Set` and :class:`Calc` (:mod:`runtime.ops_pick`)."""

    reg: str
    regs: tuple[str, ...]
    add: Operand | Affine | None = None


@dataclass(frozen=True, slots=True)
class ReadValue:
    """``reg = buf[index]`` (flat element index) of an integer buffer, once the buffer holds
    its data (a received or loaded tile of expert ids): a control value carried as data.  Loads
    of integer tensors and the messages that forward them carry their values in timing mode
    too, so control flow is the same in both modes."""

    reg: str
    buf: str
    index: int = 0


@dataclass(frozen=True, slots=True)
class WriteValue:
    """``buf[index] = value`` (flat element index) of an integer buffer: a control value a
    unit computes in registers, sent as data (a decode request's ``[row_base, n, stride]``
    cursor, STeP (arXiv 2511.07776) §5.1).  It waits until the buffer may be written (its
    pending writes and reads done), as an instruction writing the buffer does, and then takes
    no cycle; the buffer keeps its shape and its other elements."""

    buf: str
    index: int
    value: Operand | Affine


@dataclass(frozen=True, slots=True)
class Loop:
    """Run ``body`` ``count`` times; ``var`` (if given) holds the iteration index 0..count-1."""

    count: Operand | Affine
    body: tuple[Instr, ...]
    var: str | None = None


@dataclass(frozen=True, slots=True)
class Cond:
    """``lhs op rhs`` on run-time integer values."""

    lhs: Operand | Affine
    op: Literal["==", "!=", "<", "<=", ">", ">=", "&"]
    rhs: Operand | Affine


@dataclass(frozen=True, slots=True)
class If:
    """Branch on a run-time condition (``"&"`` tests a selector bit: ``(lhs & rhs) != 0``)."""

    cond: Cond
    then: tuple[Instr, ...]
    orelse: tuple[Instr, ...] = ()


@dataclass(frozen=True, slots=True)
class Barrier:
    """Wait until every core of barrier group ``group`` has arrived."""

    group: str


Instr = (
    Alloc
    | Free
    | Load
    | Store
    | Send
    | Recv
    | SendValue
    | RecvValue
    | WaitAny
    | LoadValue
    | Compute
    | Set
    | Calc
    | ArgMin
    | ReadValue
    | WriteValue
    | Loop
    | If
    | Barrier
)


def walk(body: tuple[Instr, ...]) -> Iterator[Instr]:
    """Every instruction of ``body``, a loop or branch before the instructions inside it."""
    for ins in body:
        yield ins
        if isinstance(ins, Loop):
            yield from walk(ins.body)
        elif isinstance(ins, If):
            yield from walk(ins.then)
            yield from walk(ins.orelse)


@dataclass(frozen=True, slots=True)
class Channel:
    """A named stream from core ``src`` to cores ``dsts`` (multicast when several); ``depth`` is
    the FIFO capacity in messages (``None``: the chip's ``core.fifo_depth``)."""

    name: str
    src: int
    dsts: tuple[int, ...]
    depth: int | None = None


@dataclass(frozen=True, slots=True)
class TensorDecl:
    """A tensor resident in HBM at the start (inputs, weights) or produced by stores (outputs)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bf16"


@dataclass(frozen=True, slots=True)
class Program:
    """The instruction list of one core."""

    core: int
    body: tuple[Instr, ...]


@dataclass(frozen=True, slots=True)
class ProgramSet:
    """Programs for (some of) a chip's cores plus the channels, HBM tensors and barrier groups
    they share.  Run-time data (weights, activations, routing tables, KV lengths) is bound to
    the declared tensors when the simulator runs; integer tensors always carry values."""

    programs: tuple[Program, ...]
    channels: tuple[Channel, ...] = ()
    tensors: tuple[TensorDecl, ...] = ()
    barriers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    name: str = "program"
    meta: tuple[tuple[str, str], ...] = field(default=())
