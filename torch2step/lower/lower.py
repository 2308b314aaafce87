"""Layer graph -> one STeP program (the lowering driver) and the host side of running it.

:func:`lower` declares an off-chip tensor per module input and parameter, applies the rule of
:data:`~torch2step.lower.rules.RULES` to every layer operator in order, and builds (verifies)
the STeP program.  Every operator without a rule, or whose rule rejects it, is reported in one
:class:`~torch2step.errors.LoweringError`.  The sizes the module leaves dynamic (tokens, batch,
KV length) stay symbols of the program, and the data-dependent choices (each token's experts,
each request's KV length) are data read at run time, so one :class:`Lowered` serves every input
of the captured shapes' family.

:meth:`Lowered.feed` turns module inputs into the program's off-chip tensors and size bindings
(computing the host index tensors), and :meth:`Lowered.outputs` reads the module's outputs back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy as sp
import torch

from torch2step.errors import LoweringError, StepTypeError
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph, torch_dtype
from torch2step.step import Graph, Program
from torch2step.step import fn_library_layers as _fn_layers  # noqa: F401  (registers functions)
from torch2step.step.fn_library import np_dtype

from .context import HostIndex, LowerCtx, LowerOptions, Placed
from .rules import RULES
from .rules_index import concrete

__all__ = ["Lowered", "lower"]


@dataclass
class Lowered:
    """A layer graph lowered to a STeP program, with what the host needs to run it."""

    layer: LayerGraph
    program: Program
    placed: dict[str, Placed]
    host: list[HostIndex]
    prefill: dict[str, tuple[str, Any]]
    syms: dict[sp.Symbol, sp.Symbol]
    external: tuple[str, ...] = ()
    options: LowerOptions = field(default_factory=LowerOptions)
    made_by: dict[str, str] = field(default_factory=dict)
    """STeP node name -> the layer node whose lowering rule added it."""

    def bindings(self, inputs: Sequence[torch.Tensor]) -> dict[str, int]:
        """Size of every dynamic dimension in this run (STeP symbol name -> value)."""
        env = dict(zip(self.layer.inputs, inputs))
        out: dict[str, int] = {}
        for sym, (name, axis) in self.layer.dims.items():
            out[str(sym)] = int(env[name].shape[axis])
        return out

    def feed(
        self,
        inputs: Sequence[torch.Tensor],
        overrides: Mapping[str, torch.Tensor] | None = None,
        *,
        placeholders: Collection[str] = (),
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Off-chip tensors (name -> array) and size bindings for ``step.run``.

        ``overrides`` gives the values of the ``external`` layer values (e.g. a routing
        read from a trace instead of computed by the router); the tensors named in
        ``placeholders`` (a timing-only run's inert tensors, whose values steer nothing) get
        a zero-stride array of their shape instead of a converted copy of their data."""
        b = self.bindings(inputs)
        given: dict[str, torch.Tensor] = dict(self.layer.params)
        given.update(zip(self.layer.inputs, inputs))
        for name in self.external:
            if overrides is None or name not in overrides:
                raise LoweringError(f"value {name} is external: pass it in overrides")
            given[name] = overrides[name]
        tensors: dict[str, np.ndarray] = {}
        for name, value in given.items():
            p = self.placed.get(name)
            if p is None or p.tensor.name in tensors:
                continue
            shape = concrete(p.tensor.shape, b)
            if p.tensor.name in placeholders:
                zero = np.zeros((), np_dtype(p.tensor.dtype))
                tensors[p.tensor.name] = np.broadcast_to(zero, tuple(shape))
                continue
            arr = value.detach().to("cpu")
            arr = arr.float() if arr.is_floating_point() else arr.long()
            tensors[p.tensor.name] = (
                arr.numpy().reshape(shape).astype(np_dtype(p.tensor.dtype), copy=False)
            )
        for h in self.host:
            tensors[h.tensor.name] = h.compute(b).reshape(concrete(h.tensor.shape, b))
        for tname, (src, rows_of) in self.prefill.items():
            t = next(t for t in self.program.tensors if t.name == tname)
            if tname in placeholders:
                zero = np.zeros((), np_dtype(t.dtype))
                tensors[tname] = np.broadcast_to(zero, tuple(concrete(t.shape, b)))
                continue
            buf = np.zeros(concrete(t.shape, b), np_dtype(t.dtype))
            srcv = tensors[self.placed[src].tensor.name]
            buf[rows_of(b)] = srcv.reshape(-1, buf.shape[-1])
            tensors[tname] = buf
        return tensors, b

    def outputs(
        self, tensors: Mapping[str, np.ndarray], inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """The module's outputs from the final off-chip memory of a run."""
        b = self.bindings(inputs)
        env = dict(zip(self.layer.inputs, inputs))
        outs = []
        for name in self.layer.outputs:
            if name in env:
                outs.append(env[name])
                continue
            ty = self.layer.types[name]
            shape = concrete(ty.shape, b)
            arr = tensors[self.placed[name].tensor.name].reshape(shape)
            outs.append(torch.from_numpy(np.array(arr, order="C")).to(torch_dtype(ty.dtype)))
        return tuple(outs)


def _expert_weights(layer: LayerGraph) -> set[str]:
    return {w for n in layer.ops(L.MoEExperts) for w in n.inputs[3:6]}


def _drop_unread_stores(ctx: LowerCtx, layer: LayerGraph) -> None:
    """Remove the row stores of values that no operator loads back and the layer does not
    return, with the operators that only fed them: with ``stream_rows`` every reader got the
    producer's row stream directly, so such a store only spends HBM bandwidth and makes its
    producer send each row once more (STeP §3: a stream feeds its consumers on chip;
    off-chip operators only at the boundaries of the layer)."""
    kept = {ctx.placed[o].tensor.name for o in layer.outputs if o in ctx.placed}
    kept |= set(ctx.prefill) | {h.tensor.name for h in ctx.host}
    dead = set(ctx.streamed) - kept - ctx.graph.tensors_read()
    if dead:
        ctx.graph.drop_stores(dead)


def lower(
    layer: LayerGraph,
    options: LowerOptions | None = None,
    *,
    external: Sequence[str] = (),
    name: str | None = None,
) -> Lowered:
    """Lower ``layer`` to a verified STeP program (see the module docstring).

    ``external``: layer values supplied by the caller at run time instead of computed (their
    producing operators are skipped when all their outputs are external)."""
    opts = options or LowerOptions()
    ctx = LowerCtx(layer, Graph(name or layer.name), opts)
    experts = _expert_weights(layer)
    for v in [*layer.inputs, *layer.params, *external]:
        if v in experts:
            ctx.declare(v, ctx.shape(v))
        else:
            ctx.declare(v)
    problems: list[str] = []
    made: dict[str, str] = {}  # STeP node -> the layer node whose rule added it
    skip = set(external)
    for node in layer.nodes:
        if node.outputs and all(o in skip for o in node.outputs):
            continue
        ctx.node = node
        rule = RULES.get(type(node.op))
        src = f" (at {node.source})" if node.source else ""
        if rule is None:
            problems.append(
                f"{node.name}: no lowering rule for {type(node.op).__name__}{src}; "
                f"supported: {', '.join(sorted(c.__name__ for c in RULES))}"
            )
            continue
        if any(i not in ctx.placed for i in node.inputs):
            continue  # depends on an operator already reported
        first = ctx.graph.node_count
        try:
            rule(ctx, node)
            made.update(dict.fromkeys(ctx.graph.names_since(first), node.name))
        except (LoweringError, StepTypeError) as e:
            problems.append(str(e) if str(e).startswith(node.name) else f"{node.name}: {e}")
    ctx.node = None
    if problems:
        raise LoweringError(
            f"{layer.name}: {len(problems)} operator(s) cannot be lowered to STeP:\n  "
            + "\n  ".join(problems)
        )
    missing = [o for o in layer.outputs if o not in ctx.placed]
    if missing:
        raise LoweringError(f"{layer.name}: outputs {missing} were not produced")
    if opts.stream_rows:
        _drop_unread_stores(ctx, layer)
    try:
        program = ctx.graph.build()
    except StepTypeError as e:
        raise LoweringError(f"{layer.name}: the lowered STeP graph is ill-typed: {e}") from None
    return Lowered(
        layer, program, ctx.placed, ctx.host, ctx.prefill, ctx.syms, tuple(external), opts, made
    )
