"""Timing-only runs: execute what steers control, only shape the rest.

A timing report needs the values that decide control (router logits and top-k, selectors,
addresses, KV lengths): the STeP simulator of STeP (arXiv 2511.07776) §4.2 likewise runs in a
"timing" mode that moves tile shapes, not tile data.  :func:`control_nodes` finds the nodes
whose values reach a control input — a routing operator's selector (Partition, Reassemble),
a RandomOffChipLoad / RandomOffChipStore address — through streams and through off-chip tensors
(a store feeds every load of the same tensor).  In a timing-only run
(``run(..., timing_only=True)``) a matrix product, row packing or elementwise map outside that
set returns a zero-stride array of its result's shape (no FLOPs executed, no memory held:
:data:`SHAPE_ONLY`); its FLOPs, bytes and tile
shapes are counted exactly as in a full run, so the spatial plan and every metric are
unchanged.  An off-chip tensor that no such node reads (:func:`inert_tensors`: a KV cache, a
weight) holds no values in a timing-only run — a zero-stride array of its shape, never
written — so a full-size timing run does not hold (or copy on a store) gigabytes of data it
never looks at.  ``Program.run`` stays the functional path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .graph import Program
from .ops_memory import RandomOffChipLoad, RandomOffChipStore
from .ops_routing import Partition, Reassemble

__all__ = ["SHAPE_ONLY", "control_nodes", "inert_tensors", "shape_only_impl"]


def _zeros(shape: tuple[int, ...], *like: Any) -> np.ndarray:
    """A zero-stride zero array of ``shape``, of the dtype of ``like`` (fp32 by default)."""
    dt = np.result_type(*like) if like else np.float32
    return np.broadcast_to(np.zeros((), dt), shape)


def _mm_shape(name: str, a: Any, b: Any) -> tuple[int, int]:
    n = b.shape[0] if name.startswith("matmul_t") else b.shape[1]
    return (a.shape[0], n)


def _mm(f: Any, a: Any, b: Any) -> np.ndarray:
    return _zeros(_mm_shape(f.name, a, b))


def _mm_acc(f: Any, a: Any, b: Any, state: Any) -> Any:
    shape = _mm_shape(f.name, a, b)
    if tuple(state.shape) == shape:
        return state
    return _zeros(np.broadcast_shapes(tuple(state.shape), shape))


def _rows(f: Any, row: Any, acc: Any) -> np.ndarray:
    return _zeros((acc.shape[0] + row.shape[0], acc.shape[1]))


def _bcast(f: Any, a: Any, b: Any) -> np.ndarray:
    return _zeros(np.broadcast_shapes(tuple(a.shape), tuple(b.shape)), a, b)


def _same(f: Any, x: Any, *rest: Any) -> np.ndarray:
    return _zeros(tuple(x.shape), x)


#: Tile function name -> shape-only implementation (same signature as the real one): the
#: matrix products, the row packing of dynamic tiles and the elementwise maps on data tiles.
SHAPE_ONLY: dict[str, Callable[..., Any]] = {
    "matmul": _mm,
    "matmul_t": _mm,
    "matmul_acc": _mm_acc,
    "matmul_t_acc": _mm_acc,
    "retile_row": _rows,
    **{n: _bcast for n in ("add", "sub", "mul", "div", "maximum")},
    **{n: _same for n in ("exp", "relu", "silu", "scale")},
    **{n: _same for n in ("silu_mul", "gelu_mul", "gelu_tanh_mul", "relu_mul")},
}


def shape_only_impl(fn_name: str) -> Callable[..., Any] | None:
    """The shape-only implementation of a tile function, or ``None`` (always executed)."""
    return SHAPE_ONLY.get(fn_name)


def _control_inputs(op: Any) -> tuple[Any, ...]:
    if isinstance(op, (Partition, Reassemble)):
        return (op.sel,)
    if isinstance(op, RandomOffChipLoad):
        return (op.raddr,)
    if isinstance(op, RandomOffChipStore):
        return (op.waddr,)
    return ()


def control_nodes(program: Program) -> frozenset[str]:
    """Names of the nodes whose outputs reach a control input (module docstring)."""
    producer: dict[str, Any] = {}
    writers: dict[str, list[Any]] = {}
    for op, outs in zip(program.nodes, program.node_outputs):
        for o in outs:
            producer[o.name] = op
        if type(op).__name__.endswith("Store"):
            for t in op.tensors():
                writers.setdefault(t.name, []).append(op)
    seen: set[str] = set()
    todo = [v for op in program.nodes for v in _control_inputs(op)]
    todo_ops: list[Any] = [producer[v.name] for v in todo if v.name in producer]
    while todo_ops:
        op = todo_ops.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        for v in op.inputs():
            if v.name in producer:
                todo_ops.append(producer[v.name])
        if type(op).__name__.endswith("Load"):
            for t in op.tensors():
                todo_ops.extend(writers.get(t.name, ()))
    return frozenset(seen)


def inert_tensors(program: Program) -> frozenset[str]:
    """Off-chip tensors whose values steer no control: read by no load in
    :func:`control_nodes` (their bytes are still moved and counted; only values are dropped)."""
    keep = control_nodes(program)
    read = {
        t.name
        for op in program.nodes
        if op.name in keep and type(op).__name__.endswith("Load")
        for t in op.tensors()
    }
    return frozenset(t.name for t in program.tensors if t.name not in read)
