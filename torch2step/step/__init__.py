"""The STeP IR: Streaming Tensor Programs (STeP §3, §4.1, Appendix A; STeP (revised) §3).

Streams of tiles, selectors, buffer references and tuples, structured by stop tokens, with
symbolic shapes (static, dynamic-regular and ragged sizes as sympy expressions); one frozen
dataclass per operator with its shape rule; a graph builder, verifier and printer; a
reference interpreter that defines each operator on real data and measures off-chip bytes
and on-chip allocations; and the §4.1 metric formulas.

Operators (STeP Appendix A tables 2–6, plus Repeat from Fig. 12):

* off-chip memory: LinearOffChipLoad, LinearOffChipStore, RandomOffChipLoad,
  RandomOffChipLoadRows (a dynamic run of rows per address), RandomOffChipStore;
* on-chip memory: Bufferize, Streamify;
* routing and merging: Partition, Reassemble, EagerMerge;
* higher-order: Map, Accum, Scan, FlatMap, applying named tile functions from a registry
  (``registered_fns()``; add your own with ``register_fn``);
* shape: Flatten, Reshape, Promote, Expand, Zip, Repeat.

A stream may feed several consumers (fan-out), so no separate broadcast operator exists.

Example: ``C = A @ B`` with ``A: [16*M, 64]`` (``M`` dynamic), ``B: [64, 32]``::

    import numpy as np
    from torch2step.step import Graph, dyn, metrics, run, zeros

    M = dyn("M")
    g = Graph("tiny_matmul")
    a = g.tensor("a", (16 * M, 64))
    b = g.tensor("b", (64, 32))
    c = g.tensor("c", (16 * M, 32))
    a_t = g.linear_load(a, (16, 32))             # Strm<Tile[16, 32] fp32, 2>[1, M, 2]
    a_buf = g.bufferize(a_t, 1)                  # one on-chip buffer per row block: [1, M]
    b_t = g.linear_load(b, (32, 32), ref=a_buf)  # all of B once per row block: [1, M, 2, 1]
    b_t = g.flatten(b_t, 0, 1)                   # [1, M, 2]
    a_s = g.streamify(a_buf, a_buf)              # the row block back as a stream: [1, M, 2]
    prod = g.map("matmul", a_s, b_t)             # Zip + Map: [1, M, 2] of [16, 32]
    c_t = g.accum(prod, "add", zeros(16, 32), 1) # sum over K blocks: [1, M]
    g.linear_store(c_t, c)
    prog = g.build()                             # verified
    print(prog)                                  # one line per node with its stream type

    A, B = np.random.rand(48, 64), np.random.rand(64, 32)
    res = run(prog, tensors={"a": A, "b": B})    # M = 3 is learnt from A's shape
    assert np.allclose(res.tensors["c"], A @ B, atol=1e-4)
    m = metrics(prog)                            # sympy formulas of M
    assert m.offchip_bytes == 14336 * M         # bytes, a formula of M
    assert m.evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes

Types: ``TileType((16, 64), "bf16")``, ``SelectorType(n, k)``, ``BufferType``, ``TupleType``,
``StreamType(dtype, shape, index)``; ``dyn("B")`` is a dynamic size, ``RaggedDim("L", B)``
a ragged one (``L[i]`` indexed by the axis of extent ``B``) — see ``Graph.input``.
"""

from . import fn_library as _fn_library  # noqa: F401  (registers the built-in functions)
from .dims import Index, MaxOver, RaggedDim, dyn, max_over, sum_over
from .evaluate import evaluate
from .functions import Fn, FnSpec, as_fn, fn, fn_spec, register_fn, registered_fns
from .graph import Graph, Program, zeros
from .interpreter import IMPLS, RunResult, run, to_stream
from .metrics import Metrics, metrics, offchip_traffic, onchip_memory, total_flops
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
)
from .ops_routing import EagerMerge, Partition, Reassemble
from .ops_shape import Expand, Flatten, Promote, Repeat, Reshape, Zip
from .printer import format_program, format_type
from .types import (
    ADDR,
    BOOL,
    BufferType,
    DataType,
    SelectorType,
    StreamType,
    TileType,
    TupleType,
    stream_type,
    types_equal,
)
from .values import (
    DONE,
    BufferValue,
    SelectorValue,
    StepRuntimeError,
    Stop,
    StreamValue,
    decode_tokens,
    encode_tokens,
    sel,
)
from .verify import verify

OPERATORS: tuple[type[Op], ...] = (
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipLoadRows,
    RandomOffChipStore,
    Bufferize,
    Streamify,
    Partition,
    Reassemble,
    EagerMerge,
    Map,
    Accum,
    Scan,
    FlatMap,
    Flatten,
    Reshape,
    Promote,
    Expand,
    Zip,
    Repeat,
)
"""Every operator class of the IR."""

__all__ = [
    "ADDR",
    "BOOL",
    "DONE",
    "IMPLS",
    "OPERATORS",
    "Accum",
    "BufferType",
    "BufferValue",
    "Bufferize",
    "DataType",
    "EagerMerge",
    "Expand",
    "FlatMap",
    "Flatten",
    "Fn",
    "FnSpec",
    "Graph",
    "Index",
    "LinearOffChipLoad",
    "LinearOffChipStore",
    "Map",
    "MaxOver",
    "Metrics",
    "OffChipTensor",
    "Op",
    "Partition",
    "Program",
    "Promote",
    "RaggedDim",
    "RandomOffChipLoad",
    "RandomOffChipLoadRows",
    "RandomOffChipStore",
    "Reassemble",
    "Repeat",
    "Reshape",
    "RunResult",
    "Scan",
    "SelectorType",
    "SelectorValue",
    "StepRuntimeError",
    "Stop",
    "StreamType",
    "StreamValue",
    "Streamify",
    "TileType",
    "TupleType",
    "Value",
    "Zip",
    "as_fn",
    "decode_tokens",
    "dyn",
    "encode_tokens",
    "evaluate",
    "fn",
    "fn_spec",
    "format_program",
    "format_type",
    "max_over",
    "metrics",
    "offchip_traffic",
    "onchip_memory",
    "register_fn",
    "registered_fns",
    "run",
    "sel",
    "stream_type",
    "sum_over",
    "to_stream",
    "total_flops",
    "types_equal",
    "verify",
    "zeros",
]
