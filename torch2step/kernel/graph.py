"""A layer graph as ELK operators with real tensors (the functional path of kernel execution).

* ``Linear`` -> a ``matmul`` operator (weight transposed, tile-major per its plan); with a bias,
  followed by a node adding the bias to its rows.
* ``Attention`` whose keys / values are ``Concat(cache, new)`` -> an ``attention`` operator that
  preloads the cache and adds the new token's partial on the combining core.
* ``MoEExperts`` -> dense expert operators: a routing node turns the top-k weights and indices
  into a ``tokens x experts`` weight table, then per expert two matmuls (gate, up), the SwiGLU
  node, the down matmul and a weighted accumulation node.  Every expert is loaded, also one no
  token picked (its weight column is zero, so the result is unchanged).  A shapes-only graph
  (a config, timed) has no routing to weigh: its experts are those the tokens select in
  expectation, grouped (:func:`_for_timing`).
* ``Attention`` whose keys or values are computed in the step (a layer's slice of caches
  stacked over layers, as ``models.decoder.model_step`` passes them; a scaled cache) -> a
  ``vector`` operator after its producers, with a note: an attention operator preloads its KV
  from HBM ahead of its turn (ELK §4.2), before an operator of the step stored it.
* ``Concat(cache, new)`` of a KV cache input read only by decode attention -> an append
  writing the new row into the cache in HBM (ELK §4.5: the cache is not copied); the output
  is the cache input with that row appended.
* Any other node -> a ``vector`` operator evaluating the node on one core (``layer_node``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from elk.ops import Operator, expert_rows, routed_expert_ops
from lowering.elk_kernels import register_node
from torch2step.errors import LoweringError
from torch2step.kernel.layers import active_experts
from torch2step.layers import ops as L
from torch2step.layers.evaluate import ACTIVATIONS, EVALUATORS
from torch2step.layers.graph import LayerGraph
from torch2step.step.fn_library_layers import layernorm_flops

__all__ = ["GraphOps", "graph_ops"]

_NP = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": np.float32,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
}


@dataclass
class GraphOps:
    """Operators in execution order, HBM tensors (name -> (shape, dtype)), values bound before
    the run (inputs and parameters; weights still ``K x N``, laid out tile-major later) and the
    graph's outputs as (tensor, graph shape)."""

    ops: list[Operator] = field(default_factory=list)
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    weights: dict[int, str] = field(default_factory=dict)  # op index -> weight tensor
    shapes_only: bool = False  # some input or parameter had no values (meta tensors)
    dtype: str = "fp32"  # the float dtype the layer is served in
    # output -> (cache input, appended row tensor, axis): a KV cache grown in place in HBM
    appends: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    # MoEExperts node -> (tokens, hidden, intermediate, experts, top_k): timed as routed
    # expert groups when shapes only (_for_timing)
    moe: dict[str, tuple[int, int, int, int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a timing schedule assumes

    def stored(self) -> list[str]:
        """The tensors holding the outputs (an appended cache: its new row)."""
        return [self.appends[v][1] if v in self.appends else v for v, _ in self.outputs]


def _concrete(shape: Sequence[object], env: dict[object, int]) -> tuple[int, ...]:
    return tuple(int(d.subs(env)) if hasattr(d, "subs") else int(d) for d in shape)  # type: ignore[attr-defined]


def _served(g: LayerGraph) -> str:
    """The float dtype the layer is served in (its first float input or parameter): operators,
    HBM tensors and the plan count bytes and compute rate in it; functional runs hold bf16/fp16
    values in float32 (``runtime.layout``)."""
    for v in (*g.inputs, *g.params):
        if g.types[v].dtype in ("fp32", "bf16", "fp16"):
            return g.types[v].dtype
    return "fp32"


def graph_ops(g: LayerGraph, inputs: Sequence[torch.Tensor], routing: Any = None) -> GraphOps:
    """ELK operators of ``g`` for these inputs (shapes concrete, values bound); ``routing``
    (``[tokens, k]`` expert ids): the experts a shapes-only graph's MoE node loads
    (:func:`_for_timing`)."""
    out = GraphOps()
    env_in = dict(zip(g.inputs, inputs))
    dims = {sym: int(env_in[name].shape[axis]) for sym, (name, axis) in g.dims.items()}
    shape = {v: _concrete(t.shape, dims) for v, t in g.types.items()}
    fdt = out.dtype = _served(g)
    dtype = {v: t.dtype for v, t in g.types.items()}
    producers = g.producers()
    canon: dict[str, tuple[int, ...]] = {}

    def declare(v: str, shp: tuple[int, ...] | None = None) -> str:
        want = shp or canon.get(v) or shape[v]
        if v in out.tensors:
            return v
        canon[v] = want
        out.tensors[v] = (want, dtype[v])
        return v

    for n in g.nodes:  # layouts the structured operators read and write
        if isinstance(n.op, L.Linear) and len(n.inputs) in (2, 3) and n.inputs[1] in g.params:
            k = shape[n.inputs[0]][-1]
            nn_ = shape[n.outputs[0]][-1]
            canon[n.inputs[0]] = (math.prod(shape[n.inputs[0]]) // k, k)
            canon[n.outputs[0]] = (math.prod(shape[n.outputs[0]]) // nn_, nn_)
        elif isinstance(n.op, L.Attention) and len(n.inputs) == 3 and shape[n.inputs[0]][2] == 1:
            b, hq, _, d = shape[n.inputs[0]]
            canon[n.inputs[0]] = canon[n.outputs[0]] = (b, hq, d)
    for name, x in env_in.items():
        out.values[name] = _host(x)
    for name, p in g.params.items():
        out.values[name] = _host(p)
    slot = 0

    def add(op: Operator) -> None:
        nonlocal slot
        out.ops.append(op)
        slot += 1

    def node_op(key: str, ins: list[str], outs: list[str], fn: Callable, flops: int) -> None:
        for v in ins:
            declare(v)
        for v in outs:
            declare(v)
        in_shapes = [shape[v] for v in ins]
        out_decl = tuple(out.tensors[v][0] for v in outs)

        def run(
            xs: Sequence[np.ndarray], fn: Callable = fn, in_shapes=in_shapes, out_decl=out_decl
        ):
            ts = [
                torch.from_numpy(np.ascontiguousarray(a).reshape(s)) for a, s in zip(xs, in_shapes)
            ]
            res = fn(ts)
            return tuple(
                np.ascontiguousarray(
                    (r.float() if r.dtype == torch.bfloat16 else r).detach().numpy()
                )
                .astype(_NP.get(out.tensors[v][1], np.float32))
                .reshape(sh)
                for r, v, sh in zip(res, outs, out_decl)
            )

        reg = register_node(f"{g.name}:{key}", out_decl, run)
        roles = tuple((f"in{k}", v) for k, v in enumerate(ins)) + tuple(
            (f"out{k}", v) for k, v in enumerate(outs)
        )
        elems = sum(math.prod(shape[v]) for v in outs)
        add(
            Operator(
                key,
                "vector",
                (1, max(1, elems)),
                fdt,
                slot=slot,
                tensors=roles,
                node=reg,
                flops_per_elem=max(1, flops // max(1, elems)),
            )
        )

    def matmul(key: str, x: str, wname: str, w: np.ndarray, y: str) -> None:
        k, n = w.shape
        m = math.prod(shape[x]) // k
        declare(x, (m, k))
        declare(y, (m, n))
        if not _placeholder(w):
            out.values[wname] = np.ascontiguousarray(w, np.float32)
        out.tensors[wname] = ((k, n), fdt)
        out.weights[len(out.ops)] = wname
        add(
            Operator(
                key,
                "matmul",
                (m, k, n),
                fdt,
                slot=slot,
                tensors=(("x", x), ("w", wname), ("y", y)),
            )
        )

    def generic(n: L.Node) -> None:  # type: ignore[name-defined]
        op = n.op

        def fn(ts: list[torch.Tensor], op=op, n=n) -> tuple[torch.Tensor, ...]:
            if isinstance(op, L.Reshape):
                return (ts[0].reshape(_concrete(op.shape, dims)),)
            if isinstance(op, L.Arange):
                a, b = _concrete([op.start, op.end], dims)
                return (torch.arange(a, b, dtype=torch.int64),)
            if isinstance(op, L.Slice):
                a, b = _concrete([op.start, op.end], dims)
                return (ts[0].narrow(op.dim, a, b - a),)
            return EVALUATORS[type(op)](op, ts)

        node_op(
            n.name,
            list(n.inputs),
            list(n.outputs),
            fn,
            _flops_per_elem(op) * sum(math.prod(shape[v]) for v in n.outputs),
        )

    readers: dict[str, list[L.Node]] = {}  # type: ignore[name-defined]
    for n in g.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)

    def elk_attention(n: L.Node) -> bool:  # type: ignore[name-defined]
        """A decode attention an ELK attention operator computes: one query row, the
        default 1/sqrt(d) scale, no causal or length mask (others run as vector operators)."""
        op = n.op
        if not isinstance(op, L.Attention) or len(n.inputs) != 3 or op.causal:
            return False
        b, hq, sq, d = shape[n.inputs[0]]
        return sq == 1 and (op.scale is None or math.isclose(op.scale, 1 / math.sqrt(d)))

    def appended(n: L.Node) -> bool:  # type: ignore[name-defined]
        """A KV cache append: ``Concat(cache, new)`` on the sequence axis of a cache input,
        read only by ELK decode attention (which reads cache and row itself; an attention
        run as a vector operator reads the concatenated cache, so it is made)."""
        op = n.op
        return (
            isinstance(op, L.Concat)
            and len(n.inputs) == 2
            and n.inputs[0] in g.inputs
            and len(shape[n.inputs[0]]) == 4
            and op.dim % 4 == 2
            and n.outputs[0] in g.outputs
            and all(elk_attention(r) for r in readers.get(n.outputs[0], []))
        )

    for n in g.nodes:
        op = n.op
        if appended(n):  # the new row is written into the HBM cache in place
            row = f"{n.outputs[0]}.row"
            shape[row], dtype[row] = shape[n.inputs[1]], dtype[n.outputs[0]]
            node_op(f"{n.name}.append", [n.inputs[1]], [row], lambda ts: (ts[0],), 0)
            out.appends[n.outputs[0]] = (n.inputs[0], row, 2)
        elif isinstance(op, L.Linear) and len(n.inputs) == 2 and n.inputs[1] in g.params:
            matmul(n.name, n.inputs[0], n.inputs[1] + ".T", out.values[n.inputs[1]].T, n.outputs[0])
        elif isinstance(op, L.Linear) and len(n.inputs) == 3 and n.inputs[1] in g.params:
            # with a bias: the matrix product, then the bias added to its rows (a vector op)
            y, bias = n.outputs[0], n.inputs[2]
            raw = f"{y}.nobias"
            shape[raw], dtype[raw] = shape[y], dtype[y]
            canon[raw] = canon[y]  # (rows, out), as the matrix product writes it
            matmul(n.name, n.inputs[0], n.inputs[1] + ".T", out.values[n.inputs[1]].T, raw)
            node_op(
                f"{n.name}.bias",
                [raw, bias],
                [y],
                lambda ts: (ts[0] + ts[1],),
                math.prod(shape[y]),
            )
        elif isinstance(op, L.Attention) and len(n.inputs) == 3:
            q, k, v = n.inputs
            pk, pv = producers.get(k), producers.get(v)
            b, hq, sq, d = shape[q]
            if sq != 1:
                generic(n)
                continue
            roles = [("q", declare(q, (b, hq, d)))]
            if (
                pk is not None
                and isinstance(pk.op, L.Concat)
                and pk.op.dim == 2
                and pv is not None
                and isinstance(pv.op, L.Concat)
                and pk.inputs[0] in g.inputs
                and pv.inputs[0] in g.inputs
            ):
                kc, kn, vc, vn = pk.inputs[0], pk.inputs[1], pv.inputs[0], pv.inputs[1]
                roles += [
                    ("kc", declare(kc)),
                    ("vc", declare(vc)),
                    ("kn", declare(kn)),
                    ("vn", declare(vn)),
                ]
                length = shape[kc][2]
            elif k in g.inputs and v in g.inputs:
                roles += [("kc", declare(k)), ("vc", declare(v))]
                length = shape[k][2]
            else:
                # keys or values computed in the step (a slice of a stacked cache, a scaled
                # cache): an attention operator preloads its KV from HBM ahead of its turn
                # (ELK §4.2), before an operator of the step could have stored them, so
                # the node runs as a vector operator reading them after their producers
                out.notes.append(
                    f"{n.name}: its keys or values are computed in the step, not read from a "
                    "KV cache input, so it runs as one vector operator (no KV preload); pass "
                    "each layer's cache as an input of its own to time it as ELK attention"
                )
                generic(n)
                continue
            hkv = shape[k][1]
            if not elk_attention(n):  # another scale or a mask: a vector operator
                generic(n)
                continue
            roles.append(("o", declare(n.outputs[0], (b, hq, d))))
            add(
                Operator(
                    n.name,
                    "attention",
                    (b, hq, hkv, d, length),
                    fdt,
                    slot=slot,
                    tensors=tuple(roles),
                )
            )
        elif isinstance(op, L.MoEExperts):
            if not op.gated or op.bias:
                raise LoweringError(
                    f"{n.name} (MoEExperts{f' at {n.source}' if n.source else ''}): "
                    "kernel-by-kernel execution runs gated experts without biases "
                    "(down(act(gate x) * up x)), as the STeP lowering does; this layer's experts "
                    f"are {'plain two-matrix MLPs' if not op.gated else 'biased'}, which "
                    "torch2step.layers.evaluate computes but neither execution lowers yet"
                )
            x, wts, ids, wg, wu, wd = n.inputs
            e = op.num_experts
            act = ACTIVATIONS[op.activation]
            out.moe[n.name] = (shape[x][0], shape[x][-1], shape[wg][1], e, op.top_k)
            table = f"{n.name}.cw"
            shape[table], dtype[table] = (shape[x][0], e), fdt

            def dense(ts: list[torch.Tensor], e: int = e) -> tuple[torch.Tensor, ...]:
                w, i = ts
                cw = torch.zeros(w.shape[0], e, dtype=torch.float32)
                cw.scatter_add_(1, i.long(), w.float())
                return (cw,)

            node_op(f"{n.name}.route", [wts, ids], [table], dense, 4 * shape[x][0] * e)
            final = n.outputs[0]
            running = ""
            for ex in range(e):
                gv, uv, hv, dv = (f"{n.name}.e{ex}.{s}" for s in ("g", "u", "h", "d"))
                for v, s in (
                    (gv, (shape[x][0], shape[wg][1])),
                    (uv, (shape[x][0], shape[wu][1])),
                    (hv, (shape[x][0], shape[wg][1])),
                    (dv, (shape[x][0], shape[wd][1])),
                ):
                    shape[v], dtype[v] = s, fdt
                matmul(f"{n.name}.e{ex}.gate", x, f"{wg}[{ex}].T", out.values[wg][ex].T, gv)
                matmul(f"{n.name}.e{ex}.up", x, f"{wu}[{ex}].T", out.values[wu][ex].T, uv)
                node_op(
                    f"{n.name}.e{ex}.swiglu",
                    [gv, uv],
                    [hv],
                    lambda ts, act=act: (act(ts[0]) * ts[1],),  # SwiGLU, GeGLU, ReGLU
                    5 * math.prod(shape[hv]),
                )
                matmul(f"{n.name}.e{ex}.down", hv, f"{wd}[{ex}].T", out.values[wd][ex].T, dv)
                target = final if ex == e - 1 else f"{final}.acc{ex}"
                shape[target], dtype[target] = shape[final], dtype[final]
                ins = [dv, table] if ex == 0 else [running, dv, table]

                def acc(
                    ts: list[torch.Tensor], ex: int = ex, shp=shape[final]
                ) -> tuple[torch.Tensor, ...]:
                    *prev, d_, cw = ts
                    val = d_ * cw[:, ex : ex + 1]
                    if prev:
                        val = prev[0].reshape(val.shape) + val
                    return (val.reshape(shp),)

                node_op(f"{n.name}.e{ex}.acc", ins, [target], acc, 2 * math.prod(shape[final]))
                running = target
        else:
            generic(n)
    for v in g.outputs:
        if v not in out.appends:
            declare(v)
        out.outputs.append((v, shape[v]))
    if not out.ops:
        raise LoweringError(f"{g.name}: the layer graph has no operations to schedule")
    held = {k: v for k, v in out.values.items() if not _placeholder(v)}
    out.shapes_only = len(held) < len(out.values)
    out.values = held
    if out.shapes_only:
        _for_timing(out, g, shape, routing)
    elif routing is not None:
        raise LoweringError(
            f"{g.name}: routing= times a layer compiled from shapes only (a config); with "
            "weights the router's own choice runs"
        )
    return out


_VIEWS = (L.Reshape, L.Arange)  # no data moves: dropped from a shapes-only schedule
_ROW_REDUCE = (L.RMSNorm, L.LayerNorm, L.Softmax, L.TopKRouting)


def _flops_per_elem(op: L.LayerOp) -> int:
    """FLOPs per output element of a vector operator: a LayerNorm's as its STeP tile function
    counts them (:func:`~torch2step.step.fn_library_layers.layernorm_flops`); 4 for every
    other operator."""
    if isinstance(op, L.LayerNorm):
        return layernorm_flops(op.weight, op.bias)
    return 4


def _for_timing(
    out: GraphOps, g: LayerGraph, shape: dict[str, tuple[int, ...]], routing: Any = None
) -> None:
    """A shapes-only graph (no values) is scheduled for timing as the full-size operator lists
    of :mod:`elk.ops` are: views are dropped, every other node becomes a row-partitioned
    ``vector`` operator over its first output (``rows x last dim``, ELK §5 slices every
    dimension) and operators are bound to timing tensors by
    :func:`torch2step.kernel.build.bind_timing` (activations passed core to core).  A MoE
    node's experts are those ``routing`` selects (its distinct ids), else those its tokens
    select in expectation under uniform routing, as grouped operators
    (:func:`elk.ops.routed_expert_ops`), then their weighted sum: an expert no token selects
    is not loaded (the functional path, with values, loads every expert and weighs the
    unselected by zero)."""
    kinds = {n.name: n.op for n in g.nodes}
    ops: list[Operator] = []
    timed: set[str] = set()
    for op in out.ops:
        # a MoE node's operators: "<node>.route", "<node>.e<expert>.gate", ...
        moe = next((m for m in out.moe if op.name.startswith(f"{m}.")), None)
        if moe is not None:
            if moe not in timed:
                timed.add(moe)
                by = _router(g, moe, {o.name for o in ops})
                ops += _routed_experts(out, moe, op, routing, by)
            continue
        if op.kind != "vector":
            ops.append(dataclasses.replace(op, tensors=()))
            continue
        lop = kinds.get(op.name)
        if isinstance(lop, _VIEWS):
            continue
        first = next(t for r, t in op.tensors if r.startswith("out"))
        shp = out.tensors[first][0] if first in out.tensors else shape[first]
        cols = shp[-1] if shp else 1
        rows = max(1, math.prod(shp) // max(1, cols))
        ops.append(
            dataclasses.replace(
                op,
                dims=(rows, cols),
                node=None,
                tensors=(),
                row_reduce=isinstance(lop, _ROW_REDUCE),
            )
        )
    out.ops = [dataclasses.replace(op, slot=k) for k, op in enumerate(ops)]
    out.weights = {}


def _router(g: LayerGraph, moe: str, timed: set[str]) -> str | None:
    """The timed operator computing MoE node ``moe``'s expert ids (through views, which are
    not timed), or None when none of ``timed`` does."""
    made = {v: n for n in g.nodes for v in n.outputs}
    node = next(n for n in g.nodes if n.name == moe)
    src = made.get(node.inputs[2])  # the expert ids (MoEExperts.roles)
    while src is not None and isinstance(src.op, _VIEWS) and src.inputs:
        src = made.get(src.inputs[0])
    return src.name if src is not None and src.name in timed else None


def _routed_experts(
    out: GraphOps, moe: str, first: Operator, routing: Any = None, by: str | None = None
) -> list[Operator]:
    """MoE node ``moe``'s experts for a timing schedule (:func:`_for_timing`), in place of its
    dense expert operators (``first``: the first of them); ``by``: the operator computing the
    expert ids, which their weights' preloads wait for (ELK §7 "Apply ELK to MoE")."""
    tokens, hidden, inter, experts, k = out.moe[moe]
    active = active_experts(experts, k, tokens, routing, where=f"{moe}: routing")
    if routing is None:
        how = f"as {tokens} tokens select in expectation under uniform top-{k} routing"
        counts = None
    else:
        how = f"as the routing's {tokens} tokens select, each with the rows routed to it"
        counts = expert_rows(routing, experts)
    spec = routed_expert_ops(
        tokens,
        hidden,
        inter,
        k,
        active,
        out.dtype,
        routed={"routed_by": by} if by is not None else None,
        prefix=f"{moe}.",
        counts=counts,
    )
    spec.append((f"{moe}.experts_sum", "vector", (tokens, hidden), {"flops_per_elem": 2 * k}))
    groups = sum(1 for name, *_ in spec if name.endswith("_gate_up"))
    out.notes.append(
        f"{moe}: {active} of {experts} experts active, {how} "
        f"({groups} grouped operator{'s' if groups > 1 else ''}, each timed at its busiest "
        "expert's rows); experts no token selects are not loaded"
        + (f", the others' weights preloaded once {by} has chosen them" if by is not None else "")
    )
    return [
        Operator(name, kind, dims, out.dtype, layer=first.layer, **kw)  # type: ignore[arg-type]
        for name, kind, dims, kw in spec
    ]


def _host(x: torch.Tensor) -> np.ndarray:
    """``x`` as a NumPy array; a shapes-only (meta) tensor as a zero-stride placeholder that
    holds no memory (the config-only path: timing needs shapes, not values)."""
    if x.is_meta:
        return np.broadcast_to(np.float32(0), tuple(x.shape))
    return x.detach().float().numpy() if x.is_floating_point() else x.numpy()


def _placeholder(a: np.ndarray) -> bool:
    return a.size > 1 and not any(a.strides)
