"""N identical layers that share one body: the layer graph of a model without N copies.

A :class:`Repeat` node runs ``count`` copies of one ``body`` :class:`LayerGraph` in sequence.
The body's inputs are, in order, ``carried`` values threaded from layer to layer (the hidden
state: layer ``i``'s output ``k`` is layer ``i + 1``'s input ``k``), ``stacked`` per-layer
values (each layer's KV cache: the node's input is ``[count, *body input]`` and layer ``i``
reads slice ``i``) and shared values (e.g. the requests' KV lengths, the same for every layer).
The body's outputs are the ``carried`` values then ``stacked`` per-layer results (stacked along
a new leading axis of size ``count``).  The body is stored, printed and lowered once, so a
32- or 80-layer decode step costs what one layer costs.

Weights: ``layer_params[i]`` holds layer ``i``'s parameters by body parameter name; empty, every
layer uses the body's (a config-only model, timed on stand-in values, or shared weights).
:func:`layer_signature` describes a module's structure so that a stack is only built from
layers that really are identical (:func:`check_identical`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from torch2step.errors import FrontendError

from .graph import LayerGraph
from .ops import LayerOp, TensorType, _same

__all__ = ["Repeat", "check_identical", "evaluate_repeat", "layer_signature", "stack_graph"]


@dataclass(frozen=True, eq=False)
class Repeat(LayerOp):
    """``count`` identical layers in sequence sharing ``body`` (see the module docstring);
    inputs ``(*carried, *stacked [count, ...], *shared)``."""

    count: int
    carried: int
    stacked: int
    body: LayerGraph = field(repr=False)
    layer_params: tuple[Mapping[str, torch.Tensor], ...] = field(default=(), repr=False)

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        b = self.body
        if len(ins) != len(b.inputs):
            raise FrontendError(f"Repeat: body takes {len(b.inputs)} inputs, got {len(ins)}")
        if self.layer_params and len(self.layer_params) != self.count:
            raise FrontendError(
                f"Repeat: {len(self.layer_params)} sets of layer weights for {self.count} layers"
            )
        for k, (name, t) in enumerate(zip(b.inputs, ins)):
            want = b.types[name].shape
            if self.carried <= k < self.carried + self.stacked:
                want = (self.count, *want)
            if len(t.shape) != len(want) or not all(_same(x, y) for x, y in zip(t.shape, want)):
                raise FrontendError(
                    f"Repeat: input {k} ({name}) is {list(t.shape)}, the body needs {list(want)}"
                )
        outs = []
        for k, name in enumerate(b.outputs):
            t = b.types[name]
            if k < self.carried:
                if t.shape != b.types[b.inputs[k]].shape:
                    raise FrontendError(
                        f"Repeat: carried output {name} {list(t.shape)} does not match input "
                        f"{b.inputs[k]} {list(b.types[b.inputs[k]].shape)}"
                    )
                outs.append(t)
            else:
                outs.append(TensorType((self.count, *t.shape), t.dtype))
        return tuple(outs)


def evaluate_repeat(op: Repeat, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run the layers one after the other (each with its weights, when given)."""
    from .evaluate import evaluate

    carried = list(args[: op.carried])
    stacked = args[op.carried : op.carried + op.stacked]
    shared = args[op.carried + op.stacked :]
    per_layer: list[list[torch.Tensor]] = [[] for _ in op.body.outputs[op.carried :]]
    body = op.body
    for i in range(op.count):
        if op.layer_params:
            body = _with_params(op.body, op.layer_params[i])
        outs = evaluate(body, *carried, *(s[i] for s in stacked), *shared)
        outs = outs if isinstance(outs, tuple) else (outs,)
        carried = list(outs[: op.carried])
        for acc, t in zip(per_layer, outs[op.carried :]):
            acc.append(t)
    return (*carried, *(torch.stack(ts) for ts in per_layer))


def _with_params(body: LayerGraph, params: Mapping[str, torch.Tensor]) -> LayerGraph:
    from dataclasses import replace

    missing = set(body.params) - set(params)
    if missing:
        raise FrontendError(f"Repeat: layer weights lack {sorted(missing)[:3]}")
    return replace(body, params={k: params[k] for k in body.params})


def layer_signature(module: torch.nn.Module) -> list[str]:
    """One line per submodule: its path, class, parameter shapes and the attributes that
    change what it computes (attention type, sliding window)."""
    out = []
    for path, m in module.named_modules():
        shapes = ",".join(f"{n}{list(p.shape)}" for n, p in m.named_parameters(recurse=False))
        attrs = ",".join(
            f"{a}={getattr(m, a)!r}"
            for a in ("attention_type", "sliding_window", "is_causal", "layer_type")
            if getattr(m, a, None) is not None
        )
        out.append(f"{path or '<layer>'}: {type(m).__name__}({shapes}){{{attrs}}}")
    return out


def check_identical(layers: Sequence[torch.nn.Module], what: str) -> None:
    """Raise a :class:`FrontendError` naming the first layer that differs from layer 0."""
    ref = layer_signature(layers[0])
    for i, layer in enumerate(layers[1:], start=1):
        sig = layer_signature(layer)
        if sig == ref:
            continue
        diff = next(
            (f"layer 0 has {a} but layer {i} has {b}" for a, b in zip(ref, sig) if a != b),
            f"layer 0 has {len(ref)} submodules, layer {i} has {len(sig)}",
        )
        raise FrontendError(
            f"{what}: layer {i} ({type(layer).__name__}) is not identical to layer 0 ({diff}); "
            "a repeat count needs identical layers: compile the differing layers separately"
        )


def stack_graph(
    body: LayerGraph,
    count: int,
    *,
    carried: int = 1,
    stacked: int = 2,
    layer_params: Sequence[Mapping[str, torch.Tensor]] = (),
    name: str | None = None,
) -> LayerGraph:
    """A graph of one :class:`Repeat` of ``body``: the body's inputs, the ``stacked`` ones
    with a leading axis of ``count``; outputs likewise."""
    g = LayerGraph(name=name or f"{body.name}_x{count}")
    for k, v in enumerate(body.inputs):
        t = body.types[v]
        per_layer = carried <= k < carried + stacked
        g.add_input(v, TensorType((count, *t.shape), t.dtype) if per_layer else t)
    op = Repeat(count, carried, stacked, body, tuple(layer_params))
    g.outputs = list(g.add(op, list(body.inputs), list(body.outputs)))
    g.notes = list(body.notes)
    return g
