"""Property tests over random well-typed STeP graphs (STYLE.md: minitorch strategies).

For every random graph: the verifier accepts it; the interpreter's streams have exactly the
shapes the shape rules give after substituting the run's sizes; every stream's stop-token form
decodes back to it; and each §4.1 formula (off-chip reads/writes, on-chip memory, FLOPs)
equals what the interpreter counted, node by node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from torch2step.errors import StepTypeError
from torch2step.step import (
    ADDR,
    Graph,
    Program,
    RaggedDim,
    SelectorType,
    StreamType,
    StreamValue,
    TileType,
    Value,
    decode_tokens,
    dyn,
    fn,
    metrics,
    run,
    sel,
    zeros,
)
from torch2step.step.runtime_check import check_stream
from torch2step.step.values import map_at

TILES = [(1, 1), (1, 2), (2, 2)]


@dataclass
class Case:
    prog: Program
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    streams: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)


class _Builder:
    """Builds one random graph, drawing data for every input as it is declared."""

    def __init__(self, draw: Any) -> None:
        self.draw = draw
        self.rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
        self.g = Graph("random")
        self.case = Case(prog=None)  # type: ignore[arg-type]
        self.pool: list[Value] = []
        self.n = 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def tile(self, shape: tuple[int, int]) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float32)

    # ------------------------------------------------------------------ sources
    def size(self, name: str) -> Any:
        choice = self.draw(st.sampled_from(["static", "dynamic"]))
        if choice == "static":
            return self.draw(st.integers(1, 3))
        if name not in self.case.env:
            self.case.env[name] = self.draw(st.integers(0, 3))
        return dyn(name)

    def source(self) -> None:
        kind = self.draw(st.sampled_from(["load", "ragged", "random"]))
        r, c = self.draw(st.sampled_from(TILES))
        if kind == "load":
            rows, cols = self.size("R"), self.draw(st.integers(1, 3))
            name = self.name("t")
            t = self.g.tensor(name, (rows * r, cols * c))
            rv = rows if isinstance(rows, int) else self.case.env["R"]
            self.case.tensors[name] = self.tile((rv * r, cols * c))
            self.pool.append(self.g.linear_load(t, (r, c)))
            return
        B = dyn("B")
        if "B" not in self.case.env:
            self.case.env["B"] = self.draw(st.integers(0, 3))
            self.case.env["L"] = [self.draw(st.integers(0, 3)) for _ in range(self.case.env["B"])]
        lens = self.case.env["L"]
        if kind == "ragged":
            name = self.name("x")
            v = self.g.input(name, TileType((r, c)), (1, B, RaggedDim("L", B)))
            self.case.streams[name] = [[[self.tile((r, c)) for _ in range(n)] for n in lens]]
            self.pool.append(v)
            return
        tiles = 4
        tname, aname = self.name("mem"), self.name("addr")
        t = self.g.tensor(tname, (tiles * r, c))
        self.case.tensors[tname] = self.tile((tiles * r, c))
        addr = self.g.input(aname, ADDR, (1, B, RaggedDim("L", B)))
        self.case.streams[aname] = [
            [[np.array([[int(self.rng.integers(tiles))]]) for _ in range(n)] for n in lens]
        ]
        self.pool.append(self.g.random_load(addr, t, (r, c)))

    # ------------------------------------------------------------------ steps
    def value_of(self, v: Value) -> StreamValue:
        res = run(
            self.g.snapshot(), self.case.tensors, self.case.streams, self.case.env, check=False
        )
        return res.values[v.name]

    def step(self) -> None:
        v = self.draw(st.sampled_from(self.pool))
        t = v.type
        static_tile = isinstance(t.dtype, TileType) and t.dtype.is_static
        is_tile = isinstance(t.dtype, TileType)
        ops = ["promote", "repeat", "partition"]
        if is_tile:
            ops += ["scale", "relu", "add_self", "reshape"]
        if t.rank >= 1:
            ops += ["flatten"]
        if static_tile and t.rank >= 1:
            ops += ["accum", "scan", "retile", "expand", "bufstream"]
        if static_tile:
            ops += ["split_rows"]
        op = self.draw(st.sampled_from(ops))
        g, out = self.g, None
        if op == "scale":
            out = g.map(fn("scale", alpha=0.5), v)
        elif op == "relu":
            out = g.map("relu", v)
        elif op == "add_self":
            out = g.map("add", v, v)
        elif op == "promote":
            out = g.promote(v)
        elif op == "repeat":
            out = g.repeat(v, self.draw(st.integers(1, 2)))
        elif op == "flatten":
            hi = self.draw(st.integers(1, t.rank))
            out = g.flatten(v, self.draw(st.integers(0, hi - 1)), hi)
        elif op == "reshape":
            out, _flags = g.reshape(v, 0, 2, pad=0.0)
        elif op in ("accum", "scan"):
            r, c = (int(d) for d in t.dtype.shape)  # type: ignore[attr-defined]
            rank = self.draw(st.integers(1, t.rank))
            out = (g.accum if op == "accum" else g.scan)(v, "add", zeros(r, c), rank)
        elif op == "retile":
            c = int(t.dtype.shape[1])  # type: ignore[attr-defined]
            out = g.accum(v, "retile_row", zeros(0, c), 1)
        elif op == "split_rows":
            out = g.flat_map(v, fn("retile_streamify", rows=1))
        elif op == "expand":
            r, c = (int(d) for d in t.dtype.shape)  # type: ignore[attr-defined]
            one = g.repeat(g.accum(v, "add", zeros(r, c), 1), 1)
            out = g.expand(one, v, 0)
        elif op == "bufstream":
            rank = self.draw(st.integers(1, t.rank))
            try:
                buf = g.bufferize(v, rank)
            except StepTypeError:  # a ragged inner dim cannot be buffered (seed 001 §3.2.2)
                buf = g.bufferize(v, 1)
            ref = buf if self.draw(st.booleans()) else g.repeat(buf, 2)
            out = g.streamify(buf, ref)
        elif op == "partition":
            out = self.partition(v)
        if out is not None:
            self.pool.append(out)

    def partition(self, v: Value) -> Value | None:
        t = v.type
        b = self.draw(st.integers(0, t.rank))
        n = self.draw(st.integers(1, 3))
        structure = self.value_of(v)
        sname = self.name("sel")
        stype = StreamType(SelectorType(n), t.shape[: b + 1], t.index[: b + 1])
        s = self.g.input_typed(sname, stype)

        def pick(_: Any) -> Any:
            return sel(*[k for k in range(n) if self.rng.random() < 0.6])

        self.case.streams[sname] = map_at(structure.data, b + 1, pick)
        parts = list(self.g.partition(v, s, n))
        how = self.draw(st.sampled_from(["keep", "merge", "reassemble"]))
        if how == "merge":
            data, _which = self.g.eager_merge(parts)
            return data
        if how == "reassemble":
            return self.g.reassemble(parts, s)
        self.pool.extend(parts)
        return None

    # ------------------------------------------------------------------ finish
    def finish(self) -> Case:
        snap = self.g.snapshot()
        used = {u.name for op in snap.nodes for u in op.inputs()}
        for v in snap.inputs:
            if v.name not in used:
                self.g.output(f"out_{v.name}", v)
        for op, outs in zip(snap.nodes, snap.node_outputs):
            for k, o in enumerate(outs):
                if o.name in used or k in op.optional_outputs():
                    continue
                self.sink(o)
        self.case.prog = self.g.build()
        return self.case

    def sink(self, v: Value) -> None:
        """Store a stream of static tiles off-chip (linearly or at random addresses), or make
        it a graph output."""
        t = v.type
        how = "output"
        if isinstance(t.dtype, TileType) and t.dtype.is_static:
            how = self.draw(st.sampled_from(["output", "store", "rstore"]))
        if how == "output":
            self.g.output(f"out_{v.name.replace('.', '_')}", v)
            return
        r, c = (int(d) for d in t.dtype.shape)  # type: ignore[attr-defined]
        structure = self.value_of(v)
        count = len(list(structure.elements()))
        dst = self.g.tensor(self.name("dst"), (max(count, 1) * r, c))
        if how == "store":
            self.g.linear_store(v, dst)
            return
        aname = self.name("waddr")
        addr = self.g.input_typed(aname, t.with_(dtype=ADDR))
        slots = iter(self.rng.permutation(max(count, 1)))
        self.case.streams[aname] = map_at(
            structure.data, structure.rank + 1, lambda _: np.array([[int(next(slots))]])
        )
        self.g.output(f"ack_{aname}", self.g.random_store(addr, v, dst))


@st.composite
def step_graphs(draw: Any) -> Case:
    b = _Builder(draw)
    for _ in range(draw(st.integers(1, 2))):
        b.source()
    for _ in range(draw(st.integers(0, 8))):
        b.step()
    return b.finish()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_graphs())
def test_random_graphs_shape_rules_and_metrics(case: Case) -> None:
    prog = case.prog
    res = run(prog, case.tensors, case.streams, case.env, check=False)
    # the data of every stream has the shape its rule gives once the run's sizes are known
    env = {k: (dict(enumerate(v)) if isinstance(v, list) else v) for k, v in case.env.items()}
    env = {
        k: ({(i,): x for i, x in v.items()} if isinstance(v, dict) else v) for k, v in env.items()
    }
    types = prog.values()
    for name in [v.name for v in prog.inputs] + [
        o.name for outs in prog.node_outputs for o in outs
    ]:
        check_stream(types[name].type, res.values[name], env, name)
        val = res.values[name]
        assert decode_tokens(val.tokens(), val.rank) == val.data
    # every §4.1 formula equals what the interpreter counted, node by node
    per_node = metrics(prog).evaluate_by_node(env)
    for op in prog.nodes:
        row = per_node[op.name]
        assert row["offchip_read_bytes"] == res.read_bytes[op.name], op.name
        assert row["offchip_write_bytes"] == res.write_bytes[op.name], op.name
        assert row["onchip_bytes"] == res.onchip_bytes[op.name], op.name
        assert row["flops"] == res.flops[op.name], op.name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_graphs(), st.data())
def test_type_mismatch_names_node_and_shows_ir(case: Case, data: st.DataObject) -> None:
    prog = case.prog
    with_inputs = [k for k, op in enumerate(prog.nodes) if op.inputs()]
    assume(with_inputs)
    k = data.draw(st.sampled_from(with_inputs))
    op = prog.nodes[k]
    victim = op.inputs()[0]
    wrong = Value(
        victim.name,
        victim.type.with_(shape=(*victim.type.shape, 7), index=(*victim.type.index, None)),
    )
    fields = {f: getattr(op, f) for f in op.__dataclass_fields__}  # type: ignore[attr-defined]
    for f, val in fields.items():
        if val == victim:
            fields[f] = wrong
            break
        if isinstance(val, tuple) and victim in val:
            fields[f] = tuple(wrong if x == victim else x for x in val)
            break
    broken_op = type(op)(**fields)
    nodes = (*prog.nodes[:k], broken_op, *prog.nodes[k + 1 :])
    broken = Program(prog.name, prog.tensors, prog.inputs, nodes, prog.node_outputs, prog.outputs)
    try:
        broken.verify()
    except StepTypeError as e:
        msg = str(e)
        assert f"node %{op.name} ({op.op_name})" in msg
        assert "IR around it:" in msg and ">>>   " in msg
        marked = [ln for ln in msg.splitlines() if ln.startswith(">>>")]
        assert marked and f"{op.op_name}(" in marked[0]
    else:
        raise AssertionError("a wrong input type was not detected")
