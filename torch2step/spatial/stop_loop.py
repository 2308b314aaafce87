"""A unit that loops over a stream until its stop token: one program for every element count.

A Partition's output ends with a stop token carrying its count (STeP arXiv 2511.07776 §3.2.3),
so a unit that handles each element of such a stream alike (the same messages, the same step,
the same output) need not know the count when it is built: its program is a ``Loop`` bounded by
the count's bound (the tokens routed, :func:`~.plan.count_bounds`) whose body is guarded by
``If(stop < 0)`` over ``Recv(..., stop=reg)`` — a data message runs the element's step and
sends its output, the stop token ends the unit's work (the remaining iterations test the guard
only, in zero cycles).  Its rotating buffers rotate as in the unrolled program: each iteration
handles one element per buffer copy.

The stop token is taken after the last element's step rather than before it (the unit cannot
know which element is the last), so the last element leaves as soon as it is made, not once the
Partition has routed every selector.  A ``Recv`` with ``stop`` waits for its message (the
branch depends on it), as ``RecvValue`` does.

What such a unit reads of the run is the forms of its streams' elements, not their number
(:data:`~.unit_reuse.EACH`); the elements, messages and step cycles of a run are counted from
its streams (:data:`~.unit_reuse.Tally`), so a program kept from a run with another count
(:mod:`.unit_reuse`) gets the new run's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

from lowering.isa import Cond, If, Instr, Loop, Recv, Set
from torch2step.step.op_base import Op

from .context import EmitCtx
from .streams import StreamInfo
from .unit import Elem, UnitBuilder
from .unit_reuse import EACH

__all__ = ["stop_channel", "emit_stop_loop"]

#: ``step(k, elem)``: the unit's work on element ``k`` received as ``elem``: its step(s) and
#: sends.
Step = Callable[[int, Elem], None]


def stop_channel(b: UnitBuilder, op: Op, x: StreamInfo) -> tuple[str, int] | None:
    """``(channel, bound)`` when ``op``'s unit can loop over its input ``x`` until the stop
    token: ``x`` is a rank-0 stream of a count with a bound, received whole from one channel
    that ends with a stop token, every element with the same messages (and tile shapes)."""
    shape = getattr(op.input.type, "shape", ())  # type: ignore[attr-defined]
    if len(shape) != 1 or x.value.rank != 0 or not x.flat or b.bound is None:
        return None
    chans = {ch for pc in x.pieces for ch, _, _ in pc}
    if len(chans) != 1:
        return None
    (ch,) = chans
    if ch is None or ch not in b.stops or b.own(ch) or b.next_seq.get(ch, 0):
        return None
    first = x.parts(0)
    if any(x.parts(k) != first for k in range(1, len(x.flat))):
        return None
    shape0 = getattr(x.flat[0], "shape", None)
    if any(getattr(v, "shape", None) != shape0 for v in x.flat):
        return None
    bound = b.bound(shape[0])
    if bound is None:
        return None
    return ch, bound


def emit_stop_loop(
    ctx: EmitCtx,
    b: UnitBuilder,
    x: StreamInfo,
    out: StreamInfo,
    ch: str,
    bound: int,
    step: Step,
    rotation: int = 2,
) -> None:
    """Emit the unit's loop over ``x`` (from channel ``ch``, at most ``bound`` elements) until
    its stop token, ``step`` doing each element's work (module docstring); ``out`` is the
    stream it sends one element on per element received."""
    stop = f"stop.{ch}"
    count = b.stops.pop(ch)
    b.step()
    recv0, sent0, busy0, flops0 = b.received, b.sent, b.busy_cycles, b.flops
    body: list[Instr] = []
    for _ in range(rotation):  # one element per copy of the rotating buffers
        b.next_seq[ch] = 0
        e = b.recv(x, 0)
        step(0, e)
        instrs, b.cur = b.cur, []
        first = instrs[0]
        if not isinstance(first, Recv) or first.channel != ch:  # pragma: no cover
            raise AssertionError(f"unit %{b.name}: an element must start with its receive")
        take = Recv(first.channel, first.dst, stop)
        guard = Cond(stop, "<", 0)
        body.append(If(guard, (take, If(guard, tuple(instrs[1:])))))
    per_recv = (b.received - recv0) // rotation
    per_sent = (b.sent - sent0) // rotation
    per_busy = (b.busy_cycles - busy0) // rotation
    per_flops = (b.flops - flops0) // rotation
    b.received, b.sent, b.busy_cycles, b.flops = recv0, sent0, busy0, flops0
    iterations = -(-(bound + 1) // rotation)  # every element and the stop token
    b.emit(Set(stop, -1), Loop(iterations, tuple(body)))
    b.step()
    b.next_seq[ch] = count + 1
    if out.channel is not None and b.has_dsts(out.channel):
        b.sent_seq[out.channel] = out.messages
    name = x.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        n = len(c.streams[name].flat)
        return n * per_recv, n * per_sent, n * per_busy, n * per_flops

    r, s, cyc, fl = ctx.tally(tally)
    b.received += r
    b.sent += s
    b.busy_cycles += cyc
    b.flops += fl
    ctx.relax(x.name, EACH)
    ctx.relax(out.name, EACH)
