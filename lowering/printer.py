"""A deterministic, readable text form of per-core programs (golden-testable).

One line per instruction, bodies of loops and branches indented by two spaces.  Each instruction
kind has one formatting function in :data:`_HEADS` (a table, not an ``isinstance`` ladder).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lowering.isa import (
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
    WaitAny,
    WriteValue,
)

__all__ = ["format_programs", "format_program", "format_instr", "format_value", "format_region"]


def format_value(value: Operand | Affine) -> str:
    """``3``, ``n``, ``4*t+2``, ``t-1``, ``-2*t+8`` (no spaces, so it reads inside regions)."""
    if not isinstance(value, Affine):
        return str(value)
    parts: list[str] = []
    for name, coef in value.terms:
        mag = abs(coef)
        term = name if mag == 1 else f"{mag}*{name}"
        sign = "-" if coef < 0 else ("+" if parts else "")
        parts.append(sign + term)
    if value.const or not parts:
        sign = "+" if parts and value.const > 0 else ""
        parts.append(f"{sign}{value.const}")
    return "".join(parts)


def format_region(tensor: str, region: Region | None) -> str:
    """``A`` (whole tensor), ``A[0:4, 8:12]``, ``A[4*t+2:+2, 0:4]`` (run-time start, extent 2)."""
    if region is None:
        return tensor
    dims = []
    for start, extent in zip(region.starts, region.extents):
        if isinstance(start, int) and isinstance(extent, int):
            dims.append(f"{start}:{start + extent}")
        else:
            dims.append(f"{format_value(start)}:+{format_value(extent)}")
    return f"{tensor}[{', '.join(dims)}]"


def _index(index: tuple[Index, ...]) -> str:
    return ", ".join(format_value(i) for i in index)


def _cond(cond: Cond) -> str:
    return f"{format_value(cond.lhs)} {cond.op} {format_value(cond.rhs)}"


def _compute(c: Compute) -> str:
    params = ", ".join(f"{k}={v}" for k, v in c.params)
    tail = f" {{{params}}}" if params else ""
    return f"compute {', '.join(c.outs)} <- {c.kernel}({', '.join(c.ins)}){tail} [{c.dtype}]"


def _alloc(a: Alloc) -> str:
    return f"alloc {a.buf}: {a.dtype}[{', '.join(str(d) for d in a.shape)}]"


def _store(s: Store) -> str:
    arrow = "+=" if s.accumulate else "<-"
    return f"store {format_region(s.tensor, s.region)} {arrow} {s.src}"


def _loop(loop: Loop) -> str:
    var = f" as {loop.var}" if loop.var else ""
    return f"loop {format_value(loop.count)}{var}:"


_HEADS: dict[type, Callable[..., str]] = {
    Alloc: _alloc,
    Free: lambda i: f"free {i.buf}",
    Load: lambda i: (
        f"load {i.dst} <- {format_region(i.tensor, i.region)}"
        + (" (background)" if i.background else "")
    ),
    Store: _store,
    Send: lambda i: f"send {i.channel} <- {i.src}",
    Recv: lambda i: f"recv {i.dst} <- {i.channel}" + (f" (stop -> {i.stop})" if i.stop else ""),
    SendValue: lambda i: (
        f"send_value {i.channel} <- {format_value(i.value)}" + (" (stop)" if i.stop else "")
    ),
    RecvValue: lambda i: (
        f"recv_value {i.reg} <- {i.channel}" + (f" (stop -> {i.stop})" if i.stop else "")
    ),
    WaitAny: lambda i: f"wait_any {i.reg} <- first of {', '.join(i.channels)}",
    LoadValue: lambda i: f"load_value {i.reg} <- {i.tensor}[{_index(i.index)}]",
    Compute: _compute,
    Set: lambda i: f"set {i.reg} = {format_value(i.value)}",
    Calc: lambda i: f"calc {i.reg} = {i.op}({format_value(i.lhs)}, {format_value(i.rhs)})",
    ArgMin: lambda i: (
        f"argmin {i.reg} <- {', '.join(i.regs)}"
        + ("" if i.add is None else f" (the least grows by {format_value(i.add)})")
    ),
    ReadValue: lambda i: f"read_value {i.reg} <- {i.buf}[{i.index}]",
    WriteValue: lambda i: f"write_value {i.buf}[{i.index}] <- {format_value(i.value)}",
    Loop: _loop,
    If: lambda i: f"if {_cond(i.cond)}:",
    Barrier: lambda i: f"barrier {i.group}",
}


def format_instr(instr: Instr) -> str:
    """The one-line head of ``instr`` (a loop or branch without its body)."""
    return _HEADS[type(instr)](instr)


def _lines(body: tuple[Instr, ...], indent: int, out: list[str]) -> None:
    pad = "  " * indent
    for instr in body:
        out.append(pad + format_instr(instr))
        if isinstance(instr, Loop):
            _lines(instr.body, indent + 1, out)
        elif isinstance(instr, If):
            _lines(instr.then, indent + 1, out)
            if instr.orelse:
                out.append(pad + "else:")
                _lines(instr.orelse, indent + 1, out)


def format_program(program: Program) -> str:
    """``core N:`` followed by its indented instructions."""
    out = [f"core {program.core}:"]
    _lines(program.body, 1, out)
    if not program.body:
        out.append("  (empty)")
    return "\n".join(out)


def _channel(ch: Channel) -> str:
    dsts = ", ".join(str(d) for d in ch.dsts)
    noun = "core" if len(ch.dsts) == 1 else "cores"
    depth = "default" if ch.depth is None else str(ch.depth)
    return f"channel {ch.name}: core {ch.src} -> {noun} {dsts} (depth {depth})"


def format_programs(ps: ProgramSet) -> str:
    """The whole program set: header, meta, tensors, channels, barrier groups, then every
    core's program in order.  Deterministic: same program set, same text."""
    out = [
        f"program set {ps.name!r}: {len(ps.programs)} programs, {len(ps.channels)} channels, "
        f"{len(ps.tensors)} tensors"
    ]
    out += [f"meta {k} = {v}" for k, v in ps.meta]
    for t in ps.tensors:
        size = math.prod(t.shape)
        out.append(f"tensor {t.name}: {t.dtype}[{', '.join(str(d) for d in t.shape)}] ({size} el)")
    out += [_channel(ch) for ch in ps.channels]
    for group, cores in ps.barriers:
        out.append(f"barrier {group}: cores {', '.join(str(c) for c in cores)}")
    for program in ps.programs:
        out.append("")
        out.append(format_program(program))
    return "\n".join(out) + "\n"
