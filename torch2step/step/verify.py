"""The STeP graph verifier (STYLE.md: JAX ``check_jaxpr``).

``verify(program)`` checks that a graph is well formed: every stream is produced exactly once
before it is used, every node's recorded output types equal its shape rule (STeP
Appendix A) on its input types, input types agree with their producers, ranks and ragged
indices are consistent, off-chip tensors are declared, and no stream dangles (each is
consumed, is a graph output, or is an optional output such as Reshape's padding flags).
A failure raises :class:`~torch2step.errors.StepTypeError` whose message names the node and
shows the IR around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch2step.errors import StepTypeError

from .printer import format_context
from .types import types_equal

if TYPE_CHECKING:
    from .graph import Program

__all__ = ["verify"]


def _fail(program: Program, k: int, msg: str) -> StepTypeError:
    header = [f"tensor {t}" for t in program.tensors] + [
        f"input %{v.name} : {v.type}" for v in program.inputs
    ]
    ctx = format_context(list(zip(program.nodes, program.node_outputs)), k, header=header)
    node = program.nodes[k]
    return StepTypeError(
        f"graph {program.name}: node %{node.name} ({node.op_name}): {msg}\n  IR around it:\n{ctx}"
    )


def verify(program: Program) -> None:
    """Raise :class:`StepTypeError` if ``program`` is not a well-formed STeP graph."""
    defined: dict[str, object] = {}
    tensors = {t.name: t for t in program.tensors}
    if len(tensors) != len(program.tensors):
        raise StepTypeError(f"graph {program.name}: two off-chip tensors share a name")
    for v in program.inputs:
        if v.name in defined:
            raise StepTypeError(f"graph {program.name}: input %{v.name} is declared twice")
        try:
            v.type.check()
        except StepTypeError as e:
            raise StepTypeError(f"graph {program.name}: input %{v.name}: {e}") from None
        defined[v.name] = v
    optional: set[str] = set()
    consumed: set[str] = set()
    names: set[str] = set()
    if len(program.nodes) != len(program.node_outputs):
        raise StepTypeError(f"graph {program.name}: node outputs do not match the nodes")
    for k, (op, outs) in enumerate(zip(program.nodes, program.node_outputs)):
        if op.name in names:
            raise _fail(program, k, "two nodes share this name; node names are unique")
        names.add(op.name)
        for v in op.inputs():
            src = defined.get(v.name)
            if src is None:
                raise _fail(program, k, f"input %{v.name} is not produced before this node")
            if not types_equal(src.type, v.type):  # type: ignore[attr-defined]
                raise _fail(
                    program,
                    k,
                    f"input %{v.name} has type {v.type} here but its producer gives {src.type}",  # type: ignore[attr-defined]
                )
            consumed.add(v.name)
        for t in op.tensors():
            if tensors.get(t.name) != t:
                raise _fail(program, k, f"off-chip tensor {t.name} is not declared in the graph")
        try:
            types = op.out_types()
        except StepTypeError as e:
            raise _fail(program, k, str(e)) from None
        if len(types) != len(outs) or tuple(v.name for v in outs) != op.out_names():
            raise _fail(program, k, "recorded outputs do not match the operator's outputs")
        for j, (t, v) in enumerate(zip(types, outs)):
            try:
                v.type.check()
            except StepTypeError as e:
                raise _fail(program, k, f"output %{v.name}: {e}") from None
            if not types_equal(t, v.type):
                raise _fail(
                    program, k, f"output %{v.name} is recorded as {v.type} but the rule gives {t}"
                )
            if v.name in defined:
                raise _fail(program, k, f"stream %{v.name} is produced twice")
            defined[v.name] = v
            if j in op.optional_outputs():
                optional.add(v.name)
    out_names = set()
    for name, v in program.outputs:
        if name in out_names:
            raise StepTypeError(f"graph {program.name}: output name {name!r} used twice")
        out_names.add(name)
        if v.name not in defined:
            raise StepTypeError(f"graph {program.name}: output {name} = %{v.name} is not produced")
    used = consumed | {v.name for _, v in program.outputs} | optional
    for k, outs in enumerate(program.node_outputs):
        for v in outs:
            if v.name not in used:
                raise _fail(
                    program,
                    k,
                    f"stream %{v.name} dangles: nothing consumes it; consume it or mark it "
                    "with Graph.output(name, value)",
                )
    for v in program.inputs:
        if v.name not in used:
            raise StepTypeError(
                f"graph {program.name}: input %{v.name} is never used; remove it or consume it"
            )
