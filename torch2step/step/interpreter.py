"""The STeP reference interpreter: runs a graph on real data and defines what each operator
means (STYLE.md: tinygrad ``ops_python`` — a table from operator class to a function).

``run(program, tensors=..., streams=..., env=...)`` feeds off-chip tensors (numpy or torch)
and input streams (nested lists of elements, or :class:`~torch2step.step.values.StreamValue`),
executes the nodes in order, checks every stream against its shape rule (binding the run's
dynamic sizes; ``check=False`` skips the checks that learn nothing), and returns a
:class:`RunResult` with the output streams, the final off-chip memory, the values of all
symbols and the bytes it moved off-chip and allocated on-chip.

Nothing is copied on entry: tensors and stream tiles are used in place, read-only, and a
store writes into a private copy of a tensor the caller gave (copy-on-write,
:class:`~torch2step.step.interp_context.Ctx`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import sympy as sp

from .dims import Index
from .evaluate import Bindings, normalise_env, try_evaluate
from .fn_library import np_dtype
from .graph import Program
from .interp_compute import IMPLS as _COMPUTE
from .interp_context import Ctx
from .interp_memory import IMPLS as _MEMORY
from .interp_routing import IMPLS as _ROUTING
from .interp_shape import IMPLS as _SHAPE
from .runtime_check import check_stream, unify_size
from .types import BufferType, DataType, SelectorType, StreamType, TileType, TupleType
from .values import (
    BufferValue,
    Done,
    SelectorValue,
    StepRuntimeError,
    StreamValue,
    decode_tokens,
    map_at,
)

__all__ = ["IMPLS", "RunResult", "run", "to_stream"]

IMPLS: dict[type, Callable[..., tuple]] = {**_MEMORY, **_COMPUTE, **_ROUTING, **_SHAPE}
"""Operator class -> ``f(op, ctx, inputs) -> outputs``."""


@dataclass(frozen=True)
class RunResult:
    """What a run produced and measured.

    ``read_bytes``/``write_bytes``: off-chip bytes per node; ``onchip_bytes``: on-chip bytes
    per node (largest allocation of each kind, summed); ``flops``: FLOPs per node;
    ``bindings``: every symbol's value
    (given in ``env`` or learnt from the data) for evaluating metric formulas.
    ``tensors``: the final off-chip memory — a tensor the run did not write is the caller's
    array itself, as a read-only view; tiles in the streams are read-only too.
    """

    outputs: dict[str, StreamValue]
    tensors: dict[str, np.ndarray]
    values: dict[str, StreamValue]
    bindings: Bindings
    read_bytes: dict[str, int]
    write_bytes: dict[str, int]
    onchip_bytes: dict[str, int]
    flops: dict[str, int]

    @property
    def offchip_bytes(self) -> int:
        """Total off-chip traffic in bytes (reads + writes)."""
        return sum(self.read_bytes.values()) + sum(self.write_bytes.values())

    @property
    def total_flops(self) -> int:
        """FLOPs of all tile-function applications."""
        return sum(self.flops.values())

    @property
    def onchip_total(self) -> int:
        """Total on-chip memory in bytes (sum over nodes, STeP §4.1)."""
        return sum(self.onchip_bytes.values())


def _convert(x: Any, t: DataType, where: str) -> Any:
    if isinstance(t, TileType):
        arr, _ = _borrow(x, np_dtype(t.dtype))
        arr = arr if arr.ndim == 2 else np.atleast_2d(arr)
        arr.flags.writeable = False  # tiles are values: a function must not write into one
        return arr
    if isinstance(t, SelectorType):
        if isinstance(x, SelectorValue):
            return x
        if isinstance(x, np.ndarray) and x.dtype == np.bool_:
            return SelectorValue(tuple(int(i) for i in np.flatnonzero(x)))
        return SelectorValue(tuple(int(i) for i in x))
    if isinstance(t, TupleType):
        return tuple(_convert(v, s, where) for v, s in zip(x, t.elems))
    if isinstance(t, BufferType) and isinstance(x, BufferValue):
        return x
    raise StepRuntimeError(f"{where}: cannot use {x!r} as a {t}")


def to_stream(x: Any, t: StreamType, where: str = "stream") -> StreamValue:
    """A :class:`StreamValue` of type ``t`` from a StreamValue, a token list or nested lists."""
    if isinstance(x, StreamValue):
        return StreamValue(
            x.rank, map_at(x.data, x.rank + 1, lambda e: _convert(e, t.dtype, where))
        )
    data = list(x)
    if data and isinstance(data[-1], Done):
        data = decode_tokens(data, t.rank)
    return StreamValue(t.rank, map_at(data, t.rank + 1, lambda e: _convert(e, t.dtype, where)))


def _borrow(x: Any, dtype: Any) -> tuple[np.ndarray, bool]:
    """``x`` as a numpy array of ``dtype`` without copying when it already is one, and whether
    the array may be the caller's memory (it is then handed out read-only, never written)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()  # shares the memory of a CPU tensor
    arr = np.asarray(x, dtype=dtype)
    if isinstance(x, np.ndarray):
        own = not np.may_share_memory(arr, x)
    else:  # nested lists / scalars are converted into new memory; other array-likes may not be
        own = isinstance(x, (list, tuple, int, float, bool, np.generic)) and arr.flags.owndata
    if own:
        return arr, False
    view = arr.view()
    view.flags.writeable = False
    return view, True


def _placeholder(x: Any, dtype: Any) -> np.ndarray:
    """A zero-stride zero array of ``x``'s shape: an inert tensor's data (no memory)."""
    return np.broadcast_to(np.zeros((), dtype), tuple(int(d) for d in x.shape))


def _memory(
    program: Program, tensors: Mapping[str, Any], env: Bindings, inert: frozenset[str]
) -> tuple[dict[str, np.ndarray], set[str]]:
    """Off-chip memory at the start of a run and the names of the caller's arrays in it;
    the ``inert`` tensors (timing-only runs) get zero-stride placeholders of their shape."""
    known = {t.name for t in program.tensors}
    extra = set(tensors) - known
    if extra:
        raise StepRuntimeError(f"tensors {sorted(extra)} are not in graph {program.name}")
    memory, borrowed = {}, set()
    for t in program.tensors:
        where = f"tensor {t.name}"
        if t.name in tensors:
            given = tensors[t.name]
            if t.name in inert and hasattr(given, "shape"):
                arr, shared = _placeholder(given, np_dtype(t.dtype)), True
            else:
                arr, shared = _borrow(given, np_dtype(t.dtype))
            if arr.ndim != len(t.shape):
                raise StepRuntimeError(f"{where}: {arr.ndim}-D data for {t}")
            for d, n in zip(t.shape, arr.shape):
                unify_size(d, n, {}, env, where)
            if shared:
                borrowed.add(t.name)
        else:
            dims = [try_evaluate(d, env, {}) for d in t.shape]
            if None in dims:
                raise StepRuntimeError(
                    f"{where}: give its data or the values of {sp.sstr(t.shape)} in env"
                )
            arr = np.zeros([int(d) for d in dims], dtype=np_dtype(t.dtype))  # type: ignore[arg-type]
            if t.name in inert:
                arr = _placeholder(arr, arr.dtype)
        memory[t.name] = arr
    return memory, borrowed


@lru_cache(maxsize=1 << 14)
def _size_symbols(t: StreamType) -> tuple[str, ...]:
    """Names of the symbols (indices excepted) the sizes of ``t`` use."""
    names = {
        s.name
        for e in (*t.shape, *t.dtype.exprs())
        if isinstance(e, sp.Basic) and not e.is_Integer
        for s in e.free_symbols
        if isinstance(s, sp.Symbol) and not isinstance(s, Index)
    }
    return tuple(sorted(names))


def _unbound(t: StreamType, env: Bindings) -> bool:
    """True if a size of ``t`` uses a symbol without a value in ``env``."""
    return any(n not in env for n in _size_symbols(t))


def run(
    program: Program,
    tensors: Mapping[str, Any] | None = None,
    streams: Mapping[str, Any] | None = None,
    env: Mapping[str, Any] | None = None,
    *,
    arrival: Mapping[str, Sequence[int]] | None = None,
    check: bool = True,
    timing_only: bool = False,
    store_overrides: Mapping[str, Any] | None = None,
) -> RunResult:
    """Run ``program`` on data (see the module docstring).

    ``env`` gives values of dynamic sizes (``{"B": 4, "L": [3, 5, 2, 7]}``); sizes not given
    are learnt from the data.  ``arrival`` fixes the chunk arrival order of Reassemble /
    EagerMerge nodes (:mod:`torch2step.step.interp_routing`).  With ``check`` every
    intermediate stream is compared with its shape rule; without it only the streams whose
    type has a size the run has not learnt yet (a fresh ragged size, a merge's count) are
    walked, so later nodes and the metric formulas still get every value.  Partition records
    its chunk counts itself.  ``timing_only``: matrix products that steer no control are only
    shaped, not computed (:mod:`torch2step.step.timing_only`); shapes, bytes and FLOPs are
    those of a full run, tile values are not.  ``store_overrides`` (tensor name -> array of
    the tensor's shape): a LinearOffChipStore into that tensor writes the given values instead
    of its input's (same tiles, same traffic) — a routing trace replacing a router's top-k
    choice while the router still runs.

    No input is copied: the tensors given are used in place (read-only; a store writes into a
    private copy), so ``RunResult.tensors`` holds read-only views of the tensors the run did
    not write, and loaded tiles are read-only views of off-chip memory.
    """
    tensors, streams = dict(tensors or {}), dict(streams or {})
    bindings = normalise_env(env)
    inert: frozenset[str] = frozenset()
    if timing_only:
        from .timing_only import inert_tensors

        inert = inert_tensors(program)
    memory, borrowed = _memory(program, tensors, bindings, inert)
    values: dict[str, StreamValue] = {}
    names = {v.name for v in program.inputs}
    if set(streams) - names:
        raise StepRuntimeError(f"streams {sorted(set(streams) - names)} are not graph inputs")
    for v in program.inputs:
        if v.name not in streams:
            raise StepRuntimeError(f"input stream %{v.name} ({v.type}) has no data")
        sv = to_stream(streams[v.name], v.type, f"input %{v.name}")
        check_stream(v.type, sv, bindings, f"input %{v.name}")
        values[v.name] = sv
    ctx = Ctx(memory, bindings, {k: list(s) for k, s in (arrival or {}).items()}, shared=borrowed)
    ctx.inert = inert
    if store_overrides:
        ctx.store_overrides = {k: np.asarray(v) for k, v in store_overrides.items()}
    if timing_only:
        from .timing_only import control_nodes

        keep = control_nodes(program)
        ctx.shape_only = frozenset(op.name for op in program.nodes if op.name not in keep)
    for op, outs in zip(program.nodes, program.node_outputs):
        impl = IMPLS.get(type(op))
        if impl is None:
            raise StepRuntimeError(f"no interpreter rule for {op.op_name} (node %{op.name})")
        ctx.out_types = tuple(o.type for o in outs)
        results = impl(op, ctx, tuple(values[v.name] for v in op.inputs()))
        for o, r in zip(outs, results):
            if check or _unbound(o.type, bindings):
                check_stream(o.type, r, bindings, f"{op.op_name} %{op.name} -> %{o.name}")
            values[o.name] = r
    onchip = {op.name: sum(ctx.onchip.get(op.name, {}).values()) for op in program.nodes}
    return RunResult(
        outputs={name: values[v.name] for name, v in program.outputs},
        tensors=memory,
        values=values,
        bindings=bindings,
        read_bytes={op.name: ctx.read.get(op.name, 0) for op in program.nodes},
        write_bytes={op.name: ctx.write.get(op.name, 0) for op in program.nodes},
        onchip_bytes=onchip,
        flops={op.name: ctx.flops.get(op.name, 0) for op in program.nodes},
    )
