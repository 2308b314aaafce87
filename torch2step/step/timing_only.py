"""Timing-only runs: execute what steers control, only shape the rest.

A timing report needs the values that decide control (router logits and top-k, selectors,
addresses, KV lengths): the STeP simulator of STeP (arXiv 2511.07776) §4.2 likewise runs in a
"timing" mode that moves tile shapes, not tile data.  :func:`control_nodes` finds the nodes
whose values reach a control input — a routing operator's selector (Partition, Reassemble),
a RandomOffChipLoad / RandomOffChipStore address — through streams and through off-chip tensors
(a store feeds every load of the same tensor).  In a timing-only run
(``run(..., timing_only=True)``) a matrix product, online-softmax step (FlashAttention), row
packing or elementwise map outside that set returns a zero-stride array of its result's shape
(no FLOPs executed, no memory held: :data:`SHAPE_ONLY`); its FLOPs, bytes and tile shapes are
counted exactly as in a full run, so the spatial plan and every metric are
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
from .ops_compute import Map
from .ops_memory import RandomOffChipLoad, RandomOffChipStore
from .ops_routing import EagerMerge, Partition, Reassemble
from .ops_shape import Zip

__all__ = ["SHAPE_ONLY", "control_nodes", "inert_tensors", "shape_only_impl"]


#: (shape, dtype) -> its zero-stride zero array (read-only, so one array serves every tile).
_ZEROS: dict[tuple[tuple[int, ...], np.dtype], np.ndarray] = {}


#: the dtypes of ``_zeros``'s ``like`` arrays -> their result type (NumPy 2 promotes arrays
#: by dtype alone, NEP 50), so it is computed once per combination, not once per tile
_RESULT: dict[tuple[np.dtype, ...], np.dtype] = {}


def _zeros(shape: tuple[int, ...], *like: Any) -> np.ndarray:
    """A zero-stride zero array of ``shape``, of the dtype of ``like`` (fp32 by default)."""
    if not like:
        dt = np.dtype(np.float32)
    else:
        try:
            dts = tuple([x.dtype for x in like])
        except AttributeError:  # a Python number: promoted by its value kind
            dt = np.result_type(*like)
        else:
            dt = _RESULT.get(dts)
            if dt is None:
                dt = _RESULT[dts] = np.result_type(*dts)
    key = (tuple(shape), dt)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = np.broadcast_to(np.zeros((), dt), key[0])
    return z


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """``np.broadcast_shapes(a, b)`` for two shapes of one rank (tiles), in Python; other
    cases, and shapes that do not broadcast (its error), go to NumPy."""
    if a == b:
        return a
    if len(a) != len(b):
        return np.broadcast_shapes(a, b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return np.broadcast_shapes(a, b)
    return tuple(out)


def _mm_shape(name: str, a: Any, b: Any) -> tuple[int, int]:
    n = b.shape[0] if name.startswith("matmul_t") else b.shape[1]
    return (a.shape[0], n)


def _mm(f: Any, a: Any, b: Any) -> np.ndarray:
    return _zeros(_mm_shape(f.name, a, b))


def _mm_acc(f: Any, a: Any, b: Any, state: Any) -> Any:
    shape = _mm_shape(f.name, a, b)
    if tuple(state.shape) == shape:
        return state
    return _zeros(_broadcast(tuple(state.shape), shape))


def _rows(f: Any, row: Any, acc: Any) -> np.ndarray:
    return _zeros((acc.shape[0] + row.shape[0], acc.shape[1]))


def _cols(f: Any, t: Any, acc: Any) -> np.ndarray:
    """``retile_col`` shaped: the accumulator with the tile's columns appended (a real run
    copies the whole accumulator per tile, quadratic in the row block's width)."""
    return _zeros((acc.shape[0], acc.shape[1] + t.shape[1]), acc, t)


def _bcast(f: Any, a: Any, b: Any) -> np.ndarray:
    return _zeros(_broadcast(tuple(a.shape), tuple(b.shape)), a, b)


def _same(f: Any, x: Any, *rest: Any) -> np.ndarray:
    return _zeros(tuple(x.shape), x)


def _osm(f: Any, q: Any, k: Any, v: Any, acc: tuple) -> tuple:
    """One FlashAttention step, shaped: the (max, sum, out) state of the real update."""
    m, s, o = acc
    if k.shape[0] == 0:
        return acc
    g = q.shape[0]
    return (
        _zeros(_broadcast(tuple(m.shape), (g, 1)), m, q, k),
        _zeros(_broadcast(tuple(s.shape), (g, 1)), m, s, q, k),
        _zeros(_broadcast(tuple(o.shape), (g, v.shape[1])), m, o, q, k, v),
    )


def _finalize(f: Any, m: Any, s: Any, o: Any) -> np.ndarray:
    return _zeros(tuple(o.shape), o)


#: Tile function name -> shape-only implementation (same signature as the real one): the
#: matrix products, the row and column packing of dynamic tiles and the elementwise maps on
#: data tiles.
SHAPE_ONLY: dict[str, Callable[..., Any]] = {
    "matmul": _mm,
    "matmul_t": _mm,
    "matmul_acc": _mm_acc,
    "matmul_t_acc": _mm_acc,
    "retile_row": _rows,
    "retile_col": _cols,
    "online_softmax": _osm,
    "softmax_finalize": _finalize,
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


#: Demand on a stream: ``None`` (every value of its elements) or the tuple members read.
Demand = frozenset[int] | None


def _join(a: Demand | bool, b: Demand) -> Demand:
    """The union of two demands (``False``: no demand yet)."""
    if a is False:
        return b
    if a is None or b is None:
        return None
    return a | b  # type: ignore[operator]


def _input_demands(op: Any, out: int, want: Demand) -> list[tuple[Any, Demand]]:
    """What output ``out`` of ``op``, demanded ``want``, demands of the inputs of ``op``.

    Tuple streams are followed member by member (the expert lanes of a MoE layer zip each
    result row with its token id, merge the lanes and unzip the ids to route the next step:
    only the ids steer control): ``get`` (unzip) reads one member of its input, a Zip member
    is its input, and an EagerMerge's data output carries its inputs' members unchanged while
    its selector output follows the chunk counts only (arrival order,
    :mod:`.interp_routing`), which every run computes.  Any other node reads all of every
    input."""
    if isinstance(op, Map) and op.fn.name == "get":
        return [(op.input, frozenset({int(op.fn.get("index", 0))}))]
    if isinstance(op, Zip):
        ins = op.ins if want is None else [op.ins[k] for k in sorted(want)]
        return [(v, None) for v in ins]
    if isinstance(op, EagerMerge):
        return [(v, want) for v in op.ins] if out == 0 else []
    return [(v, None) for v in op.inputs()]


def control_nodes(program: Program) -> frozenset[str]:
    """Names of the nodes whose outputs reach a control input (module docstring), followed
    through tuple members (:func:`_input_demands`)."""
    producer: dict[str, tuple[Any, int]] = {}
    writers: dict[str, list[Any]] = {}
    for op, outs in zip(program.nodes, program.node_outputs):
        for k, o in enumerate(outs):
            producer[o.name] = (op, k)
        if type(op).__name__.endswith("Store"):
            for t in op.tensors():
                writers.setdefault(t.name, []).append(op)
    seen: set[str] = set()
    demand: dict[str, Demand] = {}
    todo: list[tuple[Any, Demand]] = [(v, None) for op in program.nodes for v in _control_inputs(op)]
    whole: list[Any] = []  # stores into a tensor a control node loads: every input read

    def need(op: Any) -> None:
        if op.name in seen:
            return
        seen.add(op.name)
        if type(op).__name__.endswith("Load"):
            for t in op.tensors():
                for w in writers.get(t.name, ()):
                    whole.append(w)

    while todo or whole:
        if whole:
            op = whole.pop()
            first = op.name not in seen
            need(op)
            if first:
                todo.extend((v, None) for v in op.inputs())
            continue
        v, want = todo.pop()
        if v.name not in producer:
            continue
        old = demand.get(v.name, False)
        new = _join(old, want)
        if old is not False and new == old:
            continue
        demand[v.name] = new
        op, k = producer[v.name]
        need(op)
        todo.extend(_input_demands(op, k, new))
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
