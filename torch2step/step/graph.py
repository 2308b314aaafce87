"""Building STeP graphs: :class:`Graph` (mutable builder) and :class:`Program` (verified).

Each builder method creates one operator node, applies its shape rule at once and returns
the typed output stream(s) (:class:`~torch2step.step.op_base.Value`).  A rule violation
raises :class:`~torch2step.errors.StepTypeError` naming the node, the rule and the values,
followed by the IR built so far with the bad node marked.  ``Graph.build()`` runs the
verifier and returns an immutable :class:`Program`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch2step.errors import StepTypeError

from .dims import RaggedDim, as_dim
from .functions import Fn, as_fn, fn
from .op_base import OffChipTensor, Op, Value
from .ops_compute import Accum, FlatMap, Map, Scan
from .ops_memory import (
    Bufferize,
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipLoadRows,
    RandomOffChipStore,
    Streamify,
    row_major_strides,
)
from .ops_routing import EagerMerge, Partition, Reassemble
from .ops_shape import Expand, Flatten, Promote, Repeat, Reshape, Zip
from .printer import format_context, format_program
from .types import DataType, StreamType, TileType, stream_type
from .verify import verify

__all__ = ["Graph", "Program"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Program:
    """A verified STeP graph: off-chip tensors, input streams, nodes in topological order
    (``node_outputs[k]`` are the typed outputs of ``nodes[k]``) and named output streams."""

    name: str
    tensors: tuple[OffChipTensor, ...]
    inputs: tuple[Value, ...]
    nodes: tuple[Op, ...]
    node_outputs: tuple[tuple[Value, ...], ...]
    outputs: tuple[tuple[str, Value], ...]

    def __str__(self) -> str:
        return format_program(self)

    def node(self, name: str) -> Op:
        """The node called ``name``."""
        for op in self.nodes:
            if op.name == name:
                return op
        raise KeyError(f"graph {self.name} has no node {name!r}")

    def values(self) -> dict[str, Value]:
        """Every stream by name (inputs and node outputs)."""
        out = {v.name: v for v in self.inputs}
        for outs in self.node_outputs:
            out.update({v.name: v for v in outs})
        return out

    def verify(self) -> None:
        verify(self)


class Graph:
    """Builder of a STeP graph; see the package docstring for an example."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._tensors: dict[str, OffChipTensor] = {}
        self._inputs: list[Value] = []
        self._nodes: list[Op] = []
        self._outs: list[tuple[Value, ...]] = []
        self._outputs: list[tuple[str, Value]] = []
        self._names: set[str] = set()
        self._counters: dict[str, int] = {}

    # ------------------------------------------------------------ declarations
    def _claim(self, name: str) -> str:
        if not _NAME.match(name):
            raise StepTypeError(f"graph {self.name}: {name!r} is not a valid name (identifier)")
        if name in self._names:
            raise StepTypeError(f"graph {self.name}: name {name!r} is already used")
        self._names.add(name)
        return name

    def _auto(self, base: str, name: str | None) -> str:
        if name is not None:
            return self._claim(name)
        while True:
            k = self._counters.get(base, 0)
            self._counters[base] = k + 1
            if f"{base}{k}" not in self._names:
                return self._claim(f"{base}{k}")

    def tensor(self, name: str, shape: Sequence[object], dtype: str = "fp32") -> OffChipTensor:
        """Declare an off-chip tensor (read by loads, written by stores)."""
        t = OffChipTensor(self._claim(name), tuple(as_dim(d) for d in shape), dtype)
        self._tensors[name] = t
        return t

    def input(
        self,
        name: str,
        dtype: DataType,
        shape: Sequence[object],
        ragged: Sequence[RaggedDim] = (),
    ) -> Value:
        """Declare an input stream fed at run time (selectors, addresses, lengths...).

        ``shape`` is ``[D_r..D_0]``; a :class:`~torch2step.step.dims.RaggedDim` binds to the
        nearest outer axis of extent ``RaggedDim.outer``; ``ragged`` declares ragged sizes
        used in ``dtype`` (see :func:`~torch2step.step.types.stream_type`).
        """
        return self.input_typed(name, stream_type(dtype, shape, ragged))

    def input_typed(self, name: str, t: StreamType) -> Value:
        """Declare an input stream with an explicit :class:`StreamType`."""
        t.check()
        v = Value(self._claim(name), t)
        self._inputs.append(v)
        return v

    def output(self, name: str, value: Value) -> None:
        """Mark ``value`` as a graph output called ``name``."""
        if not _NAME.match(name) or any(n == name for n, _ in self._outputs):
            raise StepTypeError(f"graph {self.name}: bad or duplicate output name {name!r}")
        self._outputs.append((name, value))

    # ------------------------------------------------------------ generic node
    def add(self, op: Op) -> tuple[Value, ...]:
        """Add a node: run its shape rule, record and return its typed outputs."""
        try:
            types = op.out_types()
            for t in types:
                t.check()
        except StepTypeError as e:
            nodes = [*zip(self._nodes, self._outs), (op, None)]
            header = [f"tensor {t}" for t in self._tensors.values()] + [
                f"input %{v.name} : {v.type}" for v in self._inputs
            ]
            ctx = format_context(nodes, len(nodes) - 1, header=header)  # type: ignore[arg-type]
            raise StepTypeError(f"{e}\n  IR around it:\n{ctx}") from None
        outs = tuple(Value(n, t) for n, t in zip(op.out_names(), types))
        self._nodes.append(op)
        self._outs.append(outs)
        return outs

    def _one(self, op: Op) -> Value:
        return self.add(op)[0]

    # ------------------------------------------------------------ memory operators
    def linear_load(
        self,
        tensor: OffChipTensor,
        tile: Sequence[int] | TileType,
        ref: Value | None = None,
        *,
        out_shape: Sequence[object] | None = None,
        stride: Sequence[object] | None = None,
        base: int = 0,
        name: str | None = None,
    ) -> Value:
        """LinearOffChipLoad; default ``out_shape`` is the whole tiled tensor, ``stride``
        row-major."""
        tt = tile if isinstance(tile, TileType) else TileType(tuple(tile), tensor.dtype)
        if out_shape is None:
            out = tensor.tiled_shape(tt, f"LinearOffChipLoad of {tensor.name}")
        else:
            out = tuple(as_dim(d) for d in out_shape)
        st = row_major_strides(out) if stride is None else tuple(as_dim(s) for s in stride)
        return self._one(
            LinearOffChipLoad(self._auto("load", name), tensor, tt, ref, st, out, base)
        )

    def linear_store(
        self, value: Value, tensor: OffChipTensor, *, base: int = 0, name: str | None = None
    ) -> None:
        """LinearOffChipStore (a sink)."""
        self.add(LinearOffChipStore(self._auto("store", name), value, tensor, base))

    def random_load(
        self,
        raddr: Value,
        tensor: OffChipTensor,
        tile: Sequence[int] | TileType,
        *,
        base: int = 0,
        name: str | None = None,
    ) -> Value:
        """RandomOffChipLoad: one tile per address (tile index) of ``raddr``."""
        tt = tile if isinstance(tile, TileType) else TileType(tuple(tile), tensor.dtype)
        return self._one(RandomOffChipLoad(self._auto("rload", name), raddr, tensor, tt, base))

    def random_load_rows(
        self,
        raddr: Value,
        tensor: OffChipTensor,
        max_rows: int,
        *,
        base: int = 0,
        name: str | None = None,
    ) -> Value:
        """RandomOffChipLoadRows: per ``(row, r)`` address, rows ``base + row ..`` ``+ r - 1``
        of ``tensor`` (``r <= max_rows``) as one ``[r, cols]`` tile."""
        tt = TileType((max_rows, tensor.shape[-1]), tensor.dtype)
        op = RandomOffChipLoadRows(self._auto("rload", name), raddr, tensor, tt, base)
        return self._one(op)

    def random_store(
        self,
        waddr: Value,
        wdata: Value,
        tensor: OffChipTensor,
        *,
        base: int = 0,
        name: str | None = None,
    ) -> Value:
        """RandomOffChipStore; returns the acknowledgement stream (may stay unconsumed)."""
        return self._one(RandomOffChipStore(self._auto("rstore", name), waddr, wdata, tensor, base))

    def bufferize(self, value: Value, rank: int, *, name: str | None = None) -> Value:
        """Bufferize the inner ``rank`` dims."""
        return self._one(Bufferize(self._auto("buf", name), value, rank))

    def streamify(
        self,
        buffers: Value,
        ref: Value,
        *,
        stride: Sequence[object] | None = None,
        out_shape: Sequence[object] | None = None,
        name: str | None = None,
    ) -> Value:
        """Streamify: read each buffer once per element of ``ref``'s inner dims."""
        st = None if stride is None else tuple(as_dim(s) for s in stride)
        out = None if out_shape is None else tuple(as_dim(s) for s in out_shape)
        return self._one(Streamify(self._auto("strm", name), buffers, ref, st, out))

    # ------------------------------------------------------------ routing
    def partition(
        self,
        value: Value,
        sel: Value,
        num_consumers: int,
        *,
        count_names: Sequence[str] | None = None,
        name: str | None = None,
    ) -> tuple[Value, ...]:
        """Partition; returns one stream per consumer."""
        names = tuple(count_names) if count_names is not None else None
        return self.add(Partition(self._auto("part", name), value, sel, num_consumers, names))

    def reassemble(self, values: Sequence[Value], sel: Value, *, name: str | None = None) -> Value:
        """Reassemble chunks of ``values`` by selector."""
        return self._one(Reassemble(self._auto("reasm", name), tuple(values), sel))

    def eager_merge(
        self, values: Sequence[Value], *, name: str | None = None
    ) -> tuple[Value, Value]:
        """EagerMerge; returns ``(data, selector)``."""
        data, sel = self.add(EagerMerge(self._auto("merge", name), tuple(values)))
        return data, sel

    # ------------------------------------------------------------ higher-order
    def map(self, f: Fn | str, *values: Value, name: str | None = None) -> Value:
        """Map ``f``; several streams are zipped first (the Zip node is explicit)."""
        x = values[0] if len(values) == 1 else self.zip(*values)
        return self._one(Map(self._auto("map", name), x, as_fn(f)))

    def accum(
        self,
        value: Value,
        f: Fn | str,
        init: Fn,
        rank: int,
        *,
        name: str | None = None,
    ) -> Value:
        """Accum over the inner ``rank`` dims with update ``f`` and ``init``."""
        return self._one(Accum(self._auto("accum", name), value, as_fn(f), init, rank))

    def scan(
        self, value: Value, f: Fn | str, init: Fn, rank: int, *, name: str | None = None
    ) -> Value:
        """Scan over the inner ``rank`` dims."""
        return self._one(Scan(self._auto("scan", name), value, as_fn(f), init, rank))

    def flat_map(self, value: Value, f: Fn | str, *, name: str | None = None) -> Value:
        """FlatMap with a flat function."""
        return self._one(FlatMap(self._auto("flatmap", name), value, as_fn(f)))

    # ------------------------------------------------------------ shape
    def flatten(self, value: Value, min: int, max: int, *, name: str | None = None) -> Value:
        """Flatten dims ``D_max..D_min``."""
        return self._one(Flatten(self._auto("flatten", name), value, min, max))

    def reshape(
        self,
        value: Value,
        rank: int,
        chunk: int,
        pad: float | None = None,
        *,
        name: str | None = None,
    ) -> tuple[Value, Value]:
        """Reshape ``D_rank`` into chunks; returns ``(data, padding_flags)``."""
        data, flags = self.add(Reshape(self._auto("reshape", name), value, rank, chunk, pad))
        return data, flags

    def promote(self, value: Value, *, name: str | None = None) -> Value:
        """Promote: new outermost dim."""
        return self._one(Promote(self._auto("promote", name), value))

    def expand(self, value: Value, ref: Value, rank: int, *, name: str | None = None) -> Value:
        """Expand the inner ``rank+1`` unit dims of ``value`` along ``ref``."""
        return self._one(Expand(self._auto("expand", name), value, ref, rank))

    def zip(self, *values: Value, name: str | None = None) -> Value:
        """Zip streams of the same shape into tuples."""
        return self._one(Zip(self._auto("zip", name), tuple(values)))

    def repeat(self, value: Value, count: object, *, name: str | None = None) -> Value:
        """Repeat each element ``count`` times (new innermost dim)."""
        return self._one(Repeat(self._auto("repeat", name), value, as_dim(count)))

    # ------------------------------------------------------------ result
    @property
    def node_count(self) -> int:
        """How many nodes the graph holds so far (nodes are kept in the order they are added)."""
        return len(self._nodes)

    def names_since(self, first: int) -> list[str]:
        """Names of the nodes added after the first ``first`` (see :attr:`node_count`)."""
        return [op.name for op in self._nodes[first:]]

    def tensors_read(self) -> set[str]:
        """Names of the off-chip tensors some node other than a store reads."""
        stores = (LinearOffChipStore, RandomOffChipStore)
        return {t.name for op in self._nodes if not isinstance(op, stores) for t in op.tensors()}

    def drop_stores(self, dead: set[str]) -> None:
        """Remove the linear stores into the tensors ``dead``, then every node none of whose
        (non-optional) outputs is consumed any more, then the tensors of ``dead`` no node
        refers to."""
        live = [
            not (isinstance(op, LinearOffChipStore) and op.tensor.name in dead)
            for op in self._nodes
        ]
        changed = True
        while changed:
            changed = False
            used = {v.name for _, v in self._outputs}
            for k, op in enumerate(self._nodes):
                if live[k]:
                    used.update(v.name for v in op.inputs())
            for k, op in enumerate(self._nodes):
                outs = self._outs[k]
                optional = op.optional_outputs()
                if (
                    live[k]
                    and outs
                    and not any(v.name in used for v in outs)
                    and not all(j in optional for j in range(len(outs)))
                ):
                    live[k], changed = False, True
        nodes = [op for k, op in enumerate(self._nodes) if live[k]]
        referenced = {t.name for op in nodes for t in op.tensors()}
        self._nodes = nodes
        self._outs = [o for k, o in enumerate(self._outs) if live[k]]
        for name in dead - referenced:
            self._tensors.pop(name, None)

    def build(self) -> Program:
        """Verify and freeze the graph."""
        prog = self.snapshot()
        verify(prog)
        return prog

    def snapshot(self) -> Program:
        """The graph built so far as an (unverified) :class:`Program`: printable, and runnable
        by the interpreter to inspect intermediate streams while building."""
        return Program(
            self.name,
            tuple(self._tensors.values()),
            tuple(self._inputs),
            tuple(self._nodes),
            tuple(self._outs),
            tuple(self._outputs),
        )

    def __str__(self) -> str:
        return format_program(self.snapshot())


def zeros(rows: int, cols: int, dtype: str = "fp32") -> Fn:
    """Init function: a ``[rows, cols]`` tile of zeros."""
    return fn("zeros", shape=(rows, cols), dtype=dtype)
