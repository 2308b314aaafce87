"""Running a piece of the captured ATen graph on sample tensors, to decide what it means.

Raising recognises meaning, not spelling: once a pattern has found the anchors of an MoE region
or an attention mask, it runs the module's own ATen ops on random inputs and compares them with
the layer op's definition (:mod:`torch2step.layers.evaluate`).  Sizes (SymInt nodes) are taken
from a ``binding`` of the exporter's backed symbols (the example sizes by default); data-dependent
sizes (``u0`` from ``nonzero``) are computed by running the ops.

The meaning checks (:func:`classify_mask`, :func:`mask_meaning`, :func:`sample_tensor`) read the
common view and run graphs through ``view.run``, so they serve the ONNX frontend too
(:meth:`~torch2step.frontend.onnx_nodes.OnnxNodeView.run` evaluates with ``onnx.reference``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch
from torch import fx

from torch2step.frontend.fx_pattern import NoMatch
from torch2step.frontend.fx_view import (
    ProgramView,
    is_tensor_node,
    op_name,
    raw_shape,
    tensor_args,
)
from torch2step.frontend.gnode import arg_nodes
from torch2step.layers.evaluate import attention_mask

__all__ = ["upstream", "run_slice", "classify_mask", "mask_meaning", "sample_tensor"]

_SKIP = frozenset({"_assert_scalar", "_assert_tensor_metadata", "_assert_async"})


def _bound(node: fx.Node, binding: Mapping[sympy.Symbol, int]) -> bool:
    v = node.meta.get("val")
    if isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return v.node.expr.free_symbols <= set(binding)
    return isinstance(v, (int, bool, float)) and not is_tensor_node(node)


def upstream(
    view: ProgramView,
    outputs: Sequence[fx.Node],
    stop: Sequence[fx.Node],
    binding: Mapping[sympy.Symbol, int],
) -> list[fx.Node]:
    """The nodes computing ``outputs`` from ``stop`` (topological order); sizes known from
    ``binding`` end the walk."""
    seen: set[fx.Node] = set(stop)
    found: list[fx.Node] = []
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        found.append(n)
        if n.op == "placeholder" or _bound(n, binding):
            continue
        fx.node.map_arg((n.args, n.kwargs), stack.append)
    return sorted(found, key=view.index.__getitem__)


def run_slice(
    view: ProgramView,
    outputs: Sequence[fx.Node],
    feeds: Mapping[fx.Node, Any],
    binding: Mapping[sympy.Symbol, int] | None = None,
) -> list[Any]:
    """Evaluate ``outputs`` from ``feeds``; other inputs must be weights.  Raises NoMatch when
    the slice reads a run-time input that is not fed or fails to run."""
    binding = view.hints if binding is None else binding
    env: dict[fx.Node, Any] = dict(feeds)
    for n in upstream(view, outputs, list(feeds), binding):
        if n in env:
            continue
        if _bound(n, binding):
            v = n.meta["val"]
            env[n] = (
                type(v)(v) if isinstance(v, (int, bool, float)) else _subs(v.node.expr, binding)
            )
            continue
        if n.op == "placeholder":
            c = view.const(n)
            if c is None:
                raise NoMatch(f"the probed region reads the run-time input {n.name!r}")
            env[n] = c
            continue
        if op_name(n) in _SKIP:
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        if "device" in kwargs:  # probes run on CPU, also for shape-only (meta) modules
            kwargs = {**kwargs, "device": torch.device("cpu")}
        try:
            env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - a failing probe means "not this meaning"
            raise NoMatch(f"probing {n.name} failed ({type(exc).__name__}: {exc})") from exc
    return [env[o] for o in outputs]


def _subs(expr: sympy.Expr, binding: Mapping[sympy.Symbol, int]) -> Any:
    v = expr.subs(binding)
    if v in (sympy.true, sympy.false):
        return bool(v)
    return int(v)


def sample_tensor(
    view: ProgramView,
    node: fx.Node,
    binding: Mapping[sympy.Symbol, int],
    gen: torch.Generator,
) -> torch.Tensor:
    """A random tensor of ``node``'s shape (at ``binding``) and dtype."""
    shape = [view.concrete(d, binding) for d in raw_shape(node)]
    dtype = view.dtype(node)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randint(0, 4, shape, generator=gen, dtype=dtype)


def mask_meaning(samples: Iterable[tuple[int, int, int, Any, Any]]) -> bool:
    """Whether an attention mask is causal, from samples ``(B, S, L, kv_lengths or None,
    mask values)`` of it (boolean, or additive 0 / -inf), compared with the visibility of
    :class:`~torch2step.layers.ops.Attention`; raises NoMatch when it is neither causal nor a
    KV-length mask.  Both frontends decide a mask's meaning here."""
    kinds = {False, True}
    for b, s, length, lens, m in samples:
        vis = torch.as_tensor(m)
        if vis.dtype != torch.bool:
            if not bool(((vis == 0) | (vis <= -1e4)).all()):
                raise NoMatch("the additive attention mask holds values other than 0 and -inf")
            vis = vis == 0
        vis = vis.reshape((1,) * (4 - vis.dim()) + tuple(vis.shape))
        try:
            vis = torch.broadcast_to(vis, (b, vis.shape[1], s, length))
        except RuntimeError as exc:
            raise NoMatch(
                f"the attention mask of shape {tuple(vis.shape)} is not [B, 1, S, L]"
            ) from exc
        for causal in list(kinds):
            want = attention_mask(b, s, length, causal, lens)
            want = torch.ones(b, 1, s, length, dtype=torch.bool) if want is None else want
            if not torch.equal(torch.broadcast_to(want, vis.shape), vis):
                kinds.discard(causal)
    if not kinds:
        raise NoMatch("the attention mask is neither causal nor a KV-length mask")
    return min(kinds)  # prefer non-causal when both fit (S == 1)


def _runtime_inputs(view: Any, node: Any) -> list[Any]:
    """The graph inputs (not weights, not sizes) that ``node``'s value is computed from."""
    found, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found += [n] if view.is_input(n) else []
        elif isinstance(n, fx.Node):
            stack.extend(tensor_args(n))
        else:
            stack.extend(arg_nodes(n.args))
    return sorted(found, key=view.index.__getitem__)


def classify_mask(view: Any, mask: Any, q: Any, length: Any) -> tuple[bool, Any]:
    """What an attention mask means per :class:`~torch2step.layers.ops.Attention`:
    ``(causal, kv_lengths input or None)``, found by running the mask's ops (``view.run``, on
    either frontend's graph) at several sizes and KV lengths; ``length`` is the KV length (an
    expression of the graph's sizes).  Raises NoMatch when it is neither causal nor a
    KV-length mask."""
    if mask.op == "placeholder" and view.is_input(mask):
        raise NoMatch("the attention mask is a graph input; pass per-request kv_lengths[B] instead")
    inputs = _runtime_inputs(view, mask)
    if len(inputs) > 1 or any(view.dtype(n).is_floating_point or view.rank(n) != 1 for n in inputs):
        names = ", ".join(n.name for n in inputs)
        raise NoMatch(
            f"the attention mask is computed from the inputs {names}; only causal masks and "
            "masks from one integer kv_lengths[B] input have an Attention op"
        )
    kvl = inputs[0] if inputs else None
    gen = torch.Generator().manual_seed(0)
    base = dict(view.hints)
    # vary every free size (not those the module pins to one value)
    syms = sorted((s for s in base if not view.pinned(s)), key=str)
    samples = []
    for trial in range(3):
        binding = {**base, **{s: base[s] + trial * (i + 1) for i, s in enumerate(syms)}}
        b, s = (view.concrete(raw_shape(q)[i], binding) for i in (0, 2))
        kv_len = view.concrete(length, binding)
        feeds: dict[Any, Any] = {}
        lens = None
        if kvl is not None:
            lens = torch.randint(0, max(kv_len - s, 0) + 1, (b,), generator=gen)
            feeds[kvl] = lens.to(view.dtype(kvl))
        (m,) = view.run([mask], feeds, binding)
        samples.append((b, s, kv_len, lens, m))
    return mask_meaning(samples), kvl
