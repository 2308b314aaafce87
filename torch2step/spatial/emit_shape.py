"""Unit programs of the shape operators when they are not wires (STeP §3.2.5, timed by
§4.2: "for the remaining operators, we assume a single cycle latency").

By default Flatten, Promote, Zip and Reshape occupy no unit (:mod:`.structure`); with
``wires=()`` (or a subset) each becomes a unit that forwards every element with one cycle:

* **Flatten** / **Promote** — receive element ``k``, one cycle, send it (only stop tokens
  change, and they ride on the elements, :mod:`.streams`);
* **Zip** — receive element ``k`` of every input, one cycle, send the tuple (a stream zipped
  with itself is received once);
* **Reshape** — per output element: an input element is received, forwarded in one cycle and
  flagged 0; a padding tile is made in one cycle and flagged 1 (flags are control values).
"""

from __future__ import annotations

from collections.abc import Callable

from torch2step.step.op_base import Op
from torch2step.step.ops_shape import Flatten, Promote, Reshape, Zip

from .context import EmitCtx
from .unit import UnitBuilder

__all__ = ["EMITTERS"]


def _same(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, (Flatten, Promote))
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    for k in range(len(x.flat)):
        e = b.recv(x, k, rotation=2)
        b.compute(1, (e,), const=True)
        b.send(out, k, e)
        b.step()


def _zip(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Zip)
    ins = [ctx.stream(v) for v in op.ins]
    out = ctx.stream(op.name)
    for k in range(len(out.flat)):
        elems = [b.recv(x, k, rotation=2) for x in ins]
        b.compute(1, elems, const=True)
        b.send(out, k, tuple(s for e in elems for s in e))
        b.step()


def _reshape(ctx: EmitCtx, b: UnitBuilder, ops: tuple[Op, ...]) -> None:
    op = ops[0]
    assert isinstance(op, Reshape)
    x = ctx.stream(op.input)
    data, flags = (ctx.stream(n) for n in op.out_names())
    j = 0
    for k, e in enumerate(data.flat):
        if j < len(x.flat) and e is x.flat[j]:
            el = b.recv(x, j, rotation=2)
            b.compute(1, (el,), const=True)
            j += 1
        else:  # a padding tile, made here
            el = b.materialize(tuple((p, None) for p in data.parts(k)), data.parts(k))
        b.send(data, k, el)
        b.send(flags, k, tuple((p, None) for p in flags.parts(k)))
        b.step()


#: Operator class -> emitter of its unit's program.
EMITTERS: dict[type, Callable[[EmitCtx, UnitBuilder, tuple[Op, ...]], None]] = {
    Flatten: _same,
    Promote: _same,
    Zip: _zip,
    Reshape: _reshape,
}
