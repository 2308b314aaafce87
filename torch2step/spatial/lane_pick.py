"""Decode attention's lane decisions in registers (STeP arXiv 2511.07776 §5.4; the lanes of
:func:`torch2step.lower.blocks.gqa_regions.add_lane_attention`).

Each lane of decode attention makes the same decisions: a Scan(``lane_pick``) gives every
``(request, KV head)`` item to the lane with the fewest KV rows so far, and the lane's FlatMap
(``lane_keep``) keeps the items given to it.  Both are computed at run time here, so the lanes'
programs are the same for every KV-length set:

* the ``lane_pick`` Scan (:func:`emit_lane_pick`) keeps the lanes' loads in registers; per item
  it reads the item's row count from its cursor tile (``ReadValue``; the cursor Scan wrote it,
  :func:`~.kv_loop.emit_cursor_scan`), takes the least loaded lane and adds ``n + tail + 1`` to
  its load in one ``ArgMin`` (ties to the lowest lane, as ``argmin``; zero cycles, as the
  chain of ``If`` on ``<`` and ``==`` it stands for, :mod:`runtime.ops_pick`) and writes the
  lane into the state tile it sends (``WriteValue``), and the loads too unless only the
  lanes' ``lane_keep`` read the tile (they read the lane alone: :func:`lane_only_readers`);
* ``lane_keep`` (:func:`emit_lane_keep_loop`) reads the decided lane from the state tile it
  receives and sends the cursor tile under ``If`` on it, counting what it sent; after the last
  item it sends that count as the stream's stop token, which every unit of the lane loops until
  (:mod:`.item_loop`).

Both receive every item of the layer (their loops are the layer's ``B * Hkv`` items, the same
for every KV length); what they read of the run is the form of their streams.  The items a
lane keeps in a run are counted from its streams (:data:`~.unit_reuse.Tally`).
"""

from __future__ import annotations

from typing import Any

from lowering.isa import (
    Affine,
    ArgMin,
    Cond,
    If,
    Instr,
    ReadValue,
    Send,
    SendValue,
    Set,
    WriteValue,
)
from torch2step.step.op_base import Op
from torch2step.step.ops_compute import FlatMap, Scan
from torch2step.step.ops_shape import Zip

from .context import EmitCtx
from .kv_loop import _int_tile, _single, cursor_scan, lengths_carry_values, tally_into
from .streams import iter_nodes
from .structure import Structure
from .unit import UnitBuilder
from .unit_reuse import FORM

__all__ = ["lane_pick_scan", "lane_only_readers", "emit_lane_pick", "emit_lane_keep_loop"]


def lane_pick_scan(st: Structure, op: Op) -> bool:
    """Whether ``op`` is a single-node ``lane_pick`` Scan of rank 2 over the cursor tiles a
    ``kv_cursor`` Scan computes in registers (from lengths carrying their values), from an
    ``int_row`` state of ``lanes + 1`` zeros."""
    if not (
        isinstance(op, Scan)
        and getattr(op.fn, "name", None) == "lane_pick"
        and getattr(op.init, "name", None) == "int_row"
        and _single(st, op)
        and _int_tile(getattr(op.input.type, "dtype", None), (1, 3))
    ):
        return False
    lanes = int(op.fn.get("lanes", 0))
    if tuple(op.init.get("values", ())) != (0,) * (lanes + 1):
        return False
    src = st.producer.get(op.input.name)
    return (
        src is not None
        and cursor_scan(src)
        and _single(st, src)
        and lengths_carry_values(st.graph, st, src)
    )


def emit_lane_pick(ctx: EmitCtx, b: UnitBuilder, op: Scan, cost: Any) -> bool:
    """The ``lane_pick`` Scan with its loads in registers (module docstring); ``False``
    (nothing emitted) when ``op`` is not one."""
    if not lane_pick_scan(ctx.structure, op):
        return False
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    if any(len(x.parts(k)) != 1 or x.parts(k)[0].kind != "data" for k in range(len(x.flat))):
        return False
    lanes, tail = int(op.fn.get("lanes")), int(op.fn.get("tail", 0))
    load = [f"lp.{j}" for j in range(lanes)]
    loads_read = not lane_only_readers(ctx.structure, op)
    cut = x.value.rank + 1 - op.rank
    k = 0
    picks: dict[tuple[str, str], tuple[Instr, ...]] = {}
    for sub in iter_nodes(x.value.data, cut):
        b.emit(*(Set(r, 0) for r in load))
        b.step()
        state = None
        for val in iter_nodes(sub, op.rank):
            e = b.recv(x, k)
            parts = out.parts(k)
            c, fl, rule = cost.update_step(
                op.fn, val, x.dtype, out.flat[k], out.dtype, x.parts(k), parts, True
            )
            ins = (e,) if state is None else (e, state)
            state = b.compute(c, ins, parts, role="acc", flops=fl, rule=rule)
            ((_, cur),) = e
            ((_, buf),) = state
            assert cur is not None and buf is not None
            pick = picks.get((cur, buf))
            if pick is None:  # one tuple per buffer pair: equal steps share their objects
                pick = picks[cur, buf] = _pick(cur, buf, load, tail, loads_read)
            b.emit(*pick)
            b.send(out, k, state)
            k += 1
            b.step()
    ctx.relax(op.input, FORM)  # the rows reach registers: the tiles' values are the run's
    ctx.relax(op.name, FORM)  # its decisions are computed in registers
    return True


def lane_only_readers(st: Structure, op: Op) -> bool:
    """Whether every node reading the state stream of the ``lane_pick`` Scan ``op`` (through
    ``Zip`` wires) is a ``lane_keep`` FlatMap: those read the lane, the tile's last element,
    and nothing else of it (``lane_keep`` keeps the item when ``state[0, -1]`` is its lane),
    so the loads the Scan carries in the tile are never read downstream."""
    readers: dict[str, list[Op]] = {}
    for node in st.graph.nodes:
        for v in node.inputs():
            readers.setdefault(v.name, []).append(node)
    todo, seen = [op.name], set()
    while todo:
        name = todo.pop()
        for node in readers.get(name, ()):
            if isinstance(node, Zip):
                if node.name not in seen:
                    seen.add(node.name)
                    todo.append(node.name)
            elif not (isinstance(node, FlatMap) and getattr(node.fn, "name", None) == "lane_keep"):
                return False
    return True


def _pick(
    cur: str, buf: str, load: list[str], tail: int, loads_read: bool = True
) -> tuple[Instr, ...]:
    """One item's decision in registers: read its row count from the cursor tile ``cur``,
    take the least loaded lane and grow its load by ``n + tail + 1`` (one ``ArgMin``: ties to
    the lowest, as ``argmin``) and write the lane into the state tile ``buf``, and the loads
    too when something downstream reads them (``loads_read``; :func:`lane_only_readers`:
    the lanes' ``lane_keep`` read only the lane, so the loads' writes would be dead stores).
    The writes take no cycle and wait for the same thing, the tile to be writable, so the
    cycles are the same either way."""
    grow = Affine(tail + 1, (("lp.n", 1),))  # the item's rows (+1: per-item work)
    pick: list[Instr] = [ReadValue("lp.n", cur, 1), ArgMin("lp.lane", tuple(load), grow)]
    if loads_read:
        pick += [WriteValue(buf, j, r) for j, r in enumerate(load)]
    pick.append(WriteValue(buf, len(load), "lp.lane"))
    return tuple(pick)


def emit_lane_keep_loop(ctx: EmitCtx, b: UnitBuilder, op: FlatMap) -> bool:
    """A lane's ``lane_keep`` sending each cursor tile under ``If`` on the lane decided in
    registers, then the count it sent as the stop token (module docstring); ``False`` when
    its output is not one of a looped lane (:mod:`.item_loop`)."""
    if op.name not in ctx.looped:
        return False
    zipped = ctx.structure.producer[op.input.name]
    assert isinstance(zipped, Zip)
    x, out = ctx.stream(op.input), ctx.stream(op.name)
    lane = int(op.fn.get("lane"))
    where = 1 + int(ctx.structure.producer[zipped.ins[1].name].fn.get("lanes"))  # type: ignore[attr-defined]
    sends = out.channel is not None and b.has_dsts(out.channel)
    b.emit(Set("lk.n", 0))
    b.step()
    count = Set("lk.n", Affine(1, (("lk.n", 1),)))
    is_lane = Cond("lk.lane", "==", lane)
    for k in range(len(x.flat)):
        e = b.recv(x, k)
        (_, cur), (_, state) = e
        assert cur is not None and state is not None
        b.compute(1, (e,), const=True)
        keep: tuple[Instr, ...] = (count,)
        if sends and out.channel is not None:
            keep = (b.make(Send, out.channel, cur), count)
        b.emit(b.make(ReadValue, "lk.lane", state, where - 1), b.make(If, is_lane, keep))
        b.step()
    if sends and out.channel is not None:
        b.emit(SendValue(out.channel, "lk.n"))
        b.sent_seq[out.channel] = out.messages + 1
    b.step()
    name = op.name

    def tally(c: EmitCtx) -> tuple[int, int, int, int]:
        return 0, len(c.streams[name].flat) * sends, 0, 0

    tally_into(ctx, b, tally)
    ctx.relax(op.input, FORM)
    ctx.relax(op.name, None)  # which items it keeps is decided at run time
    return True
