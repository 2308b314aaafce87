"""Text form of STeP graphs: one line per node with its stream types (deterministic).

Example::

    step.graph tiny {
      tensor a: [64, 32] fp32
      %load0 = LinearOffChipLoad(; tensor=a, tile=Tile[16, 32] fp32, stride=[1], ...) : Strm<...>
      LinearOffChipStore(%accum0; tensor=c, base=0)
      output c_tiles = %accum0
    }

Sizes print as sympy expressions; an axis that a ragged size refers to shows its index
(``B:i`` in ``[1, B:i, L[i]]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sympy as sp

from .functions import Fn
from .op_base import Op, Value
from .types import DataType, StreamType

if TYPE_CHECKING:
    from .graph import Program

__all__ = ["format_context", "format_node", "format_program", "format_type"]


def format_type(t: StreamType) -> str:
    """``Strm<Tile[16, 64] fp32, 1>[1, B:i, L[i]]``."""
    return str(t)


def _param(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, (Fn, DataType)):
        return str(v)
    if isinstance(v, sp.Basic):
        return sp.sstr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_param(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def format_node(op: Op, outs: Sequence[Value] | None) -> list[str]:
    """The line(s) of one node; ``outs=None`` when its type rule failed."""
    args = ", ".join(str(v) for v in op.inputs())
    params = ", ".join(f"{k}={_param(v)}" for k, v in op.params())
    call = f"{op.op_name}({args}{'; ' + params if params else ''})"
    names = [f"%{n}" for n in op.out_names()]
    if not names:
        return [call]
    lhs = ", ".join(names) + " = "
    if outs is None:
        return [lhs + call + " : <type rule failed>"]
    if len(outs) == 1:
        return [lhs + call + " : " + format_type(outs[0].type)]
    return [lhs + call] + [f"    %{v.name} : {format_type(v.type)}" for v in outs]


def _header_lines(program: Program) -> list[str]:
    lines = [f"tensor {t}" for t in program.tensors]
    lines += [f"input %{v.name} : {format_type(v.type)}" for v in program.inputs]
    return lines


def format_program(program: Program) -> str:
    """The whole graph."""
    body = _header_lines(program)
    for op, outs in zip(program.nodes, program.node_outputs):
        body += format_node(op, outs)
    body += [f"output {name} = %{v.name}" for name, v in program.outputs]
    return f"step.graph {program.name} {{\n" + "\n".join("  " + ln for ln in body) + "\n}"


def format_context(
    nodes: Sequence[tuple[Op, Sequence[Value] | None]],
    bad: int,
    radius: int = 3,
    header: Sequence[str] = (),
) -> str:
    """The IR around node ``bad`` (``radius`` nodes either side), the bad node marked ``>>>``."""
    lo, hi = max(0, bad - radius), min(len(nodes), bad + radius + 1)
    lines = [f"      {h}" for h in header] if lo == 0 else ["      ..."]
    for k in range(lo, hi):
        op, outs = nodes[k]
        mark = ">>>   " if k == bad else "      "
        lines += [mark + ln for ln in format_node(op, outs)]
    if hi < len(nodes):
        lines.append("      ...")
    return "\n".join(lines)
