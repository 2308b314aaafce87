"""What each layer operation computes: a table from op class to a torch function.

``evaluate(graph, *inputs)`` runs a :class:`~torch2step.layers.graph.LayerGraph` eagerly; tests
use it to show that raising kept the model's meaning before anything is lowered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from torch2step.errors import FrontendError, InputError
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph, Node, torch_dtype
from torch2step.layers.stack import Repeat, evaluate_repeat
from torch2step.step.fn_library_layers import rope_inv_freq

__all__ = [
    "evaluate",
    "evaluate_node",
    "dim_sizes",
    "EVALUATORS",
    "rotary_cos_sin",
    "attention_mask",
]

Fn = Callable[[object, Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b``; two integer tensors divide truncating toward zero (ONNX ``Div``, STeP's
    ``div`` tile function), keeping the integer dtype the layer graph gives the quotient."""
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (Hendrycks & Gimpel, "Gaussian Error Linear Units", §2): PyTorch's
    ``gelu(approximate="tanh")``, HF's ``gelu_pytorch_tanh`` / ``gelu_new``."""
    return F.gelu(x, approximate="tanh")


_ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": _div,
    "maximum": torch.maximum,
    "where": torch.where,
    "neg": torch.neg,
    "exp": torch.exp,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "rsqrt": torch.rsqrt,
    "sqrt": torch.sqrt,
    "reciprocal": torch.reciprocal,
    "square": torch.square,
}


_SCALAR: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "add_scalar": torch.add,
    "mul_scalar": torch.mul,
    "pow_scalar": torch.pow,
}


def _elementwise(op: L.Elementwise, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    scalar = _SCALAR.get(op.fn)
    if scalar is None:
        return (_ELEMENTWISE[op.fn](*x),)
    t = x[0]
    if t.is_floating_point():
        return (scalar(t, op.scalar),)
    # an integer value keeps its dtype (the layer graph's type): computed in float64 and
    # truncated toward zero, as STeP's tile functions do (an integer ``Div`` by a constant is a
    # ``div`` by a one-element tensor: ``x * (1/49)`` would truncate 49 / 49 to 0)
    return (scalar(t.double(), op.scalar).to(t.dtype),)


def _gather(op: L.Gather, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``src.index_select(dim, idx)`` where a negative index counts from the end (``idx +
    size``), as ONNX ``Gather`` and PyTorch's ``src[..., idx]`` do."""
    src, idx = x
    size = src.shape[op.dim]
    bad = idx[(idx < -size) | (idx >= size)]
    if bad.numel():
        raise InputError(
            f"Gather along dim {op.dim} (size {size}): index {int(bad[0])} is outside "
            f"[-{size}, {size})"
        )
    return (src.index_select(op.dim, torch.where(idx < 0, idx + size, idx)),)


def _rmsnorm(op: L.RMSNorm, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    h, w = x
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + op.eps)
    return (w * y.to(h.dtype),)


def _layernorm(op: L.LayerNorm, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Ba et al., "Layer Normalization", §3: each row less its mean, over its standard
    deviation (biased, ``eps`` added to the variance), then the gain and bias; in fp32 and
    rounded once to x's dtype (as PyTorch's ``layer_norm`` computes)."""
    h, rest = x[0], list(x[1:])
    w = rest.pop(0).float() if op.weight else None
    b = rest.pop(0).float() if op.bias else None
    y = F.layer_norm(h.float(), (h.shape[-1],), w, b, op.eps)
    return (y.to(h.dtype),)


def rotary_cos_sin(
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int,
    table_dtype: str = "float32",
    inv_freq: Sequence[float] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[B, S, rotary_dim]`` for integer ``positions[B, S]`` (HF's
    default RoPE: ``inv_freq = theta ** -(arange(0, d, 2) / d)`` held in ``table_dtype``,
    halves concatenated; ``inv_freq``: a scaled RoPE's own table instead)."""
    inv_freq = rope_inv_freq(theta, rotary_dim, table_dtype, inv_freq)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotary(op: L.Rotary, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    h, pos = x
    cos, sin = rotary_cos_sin(pos, op.theta, op.rotary_dim, op.table_dtype, op.inv_freq)
    cos, sin = cos[:, None].to(h.dtype), sin[:, None].to(h.dtype)
    rot, rest = h[..., : op.rotary_dim], h[..., op.rotary_dim :]
    half = op.rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return (torch.cat((rot * cos + rotated * sin, rest), dim=-1),)


def _topk(op: L.TopKRouting, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    (logits,) = x
    if op.softmax_first:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, e = torch.topk(probs, op.k, dim=-1)
    else:
        top, e = torch.topk(logits, op.k, dim=-1)
        w = torch.softmax(top, dim=-1, dtype=torch.float32)
    if op.normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return (w.to(logits.dtype), e)


#: the experts' activations a MoEExperts computes (its ``activation``)
ACTIVATIONS = {a: _ELEMENTWISE[a] for a in ("silu", "gelu", "gelu_tanh", "relu")}


def _moe(op: L.MoEExperts, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    t = dict(zip(op.roles(), x))
    h, w, e = t["x"], t["weights"], t["experts"]
    out = torch.zeros_like(h)
    act = ACTIVATIONS[op.activation]

    def proj(name: str, ex: int, v: torch.Tensor) -> torch.Tensor:
        y = v @ t["w_" + name][ex].T
        return y + t["b_" + name][ex] if op.bias else y

    for ex in range(op.num_experts):
        tok, slot = torch.where(e == ex)
        if tok.numel() == 0:
            continue
        xs = h[tok]
        mid = (
            act(proj("gate", ex, xs)) * proj("up", ex, xs) if op.gated else act(proj("up", ex, xs))
        )
        y = proj("down", ex, mid)
        out.index_add_(0, tok, y * w[tok, slot, None].to(y.dtype))
    return (out,)


def attention_mask(
    b: int, s: int, length: int, causal: bool, kv_lengths: torch.Tensor | None
) -> torch.Tensor | None:
    """Boolean visibility ``[B, 1, S, L]`` per :class:`~torch2step.layers.ops.Attention`."""
    if not causal and kv_lengths is None:
        return None
    j = torch.arange(length)
    mask = torch.ones(b, 1, s, length, dtype=torch.bool)
    if causal:
        i = torch.arange(s)[:, None]
        mask &= (j[None, :] <= length - s + i)[None, None]
    if kv_lengths is not None:
        cached = j[None, :] < kv_lengths.reshape(b, 1)
        new = (j >= length - s)[None, :]
        mask &= (cached | new)[:, None, None, :]
    return mask


def _attention(op: L.Attention, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    q, k, v = x[:3]
    kv_lengths = x[3] if len(x) > 3 else None
    mask = attention_mask(q.shape[0], q.shape[2], k.shape[2], op.causal, kv_lengths)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=op.scale, enable_gqa=op.num_q_heads != op.num_kv_heads
    )
    return (out,)


def _reduce(op: L.Reduce, x: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    t = x[0]
    if op.fn == "sum":
        return (t.sum(dim=op.dims, keepdim=op.keepdim),)
    if op.fn == "mean":
        return (t.mean(dim=op.dims, keepdim=op.keepdim),)
    if op.fn == "max":
        return (t.amax(dim=op.dims, keepdim=op.keepdim),)
    raise FrontendError(f"Reduce: unknown function {op.fn!r}")


def _concrete(shape: Sequence[object], env: dict[object, int]) -> list[int]:
    return [int(d.subs(env)) if hasattr(d, "subs") else int(d) for d in shape]  # type: ignore[attr-defined]


EVALUATORS: dict[type, Callable[..., tuple[torch.Tensor, ...]]] = {
    L.Linear: lambda op, x: (F.linear(*x),),
    L.MatMul: lambda op, x: (x[0] @ x[1],),
    L.Elementwise: _elementwise,
    L.RMSNorm: _rmsnorm,
    L.LayerNorm: _layernorm,
    L.Softmax: lambda op, x: (torch.softmax(x[0].float(), dim=op.dim).to(x[0].dtype),),
    L.Rotary: _rotary,
    L.TopKRouting: _topk,
    L.MoEExperts: _moe,
    L.Attention: _attention,
    L.Concat: lambda op, x: (torch.cat(list(x), dim=op.dim),),
    L.Gather: _gather,
    L.Permute: lambda op, x: (x[0].permute(op.dims),),
    L.Reduce: _reduce,
    L.Cast: lambda op, x: (x[0].to(torch_dtype(op.dtype)),),
}


def evaluate(graph: LayerGraph, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Run ``graph`` eagerly on ``inputs`` (in ``graph.inputs`` order)."""
    if len(inputs) != len(graph.inputs):
        raise FrontendError(f"{graph.name}: expected {len(graph.inputs)} inputs, got {len(inputs)}")
    env: dict[str, torch.Tensor] = dict(graph.params)
    env.update(zip(graph.inputs, inputs))
    dims = dim_sizes(graph, env)
    for node in graph.nodes:
        env.update(zip(node.outputs, evaluate_node(node, [env[i] for i in node.inputs], dims)))
    result = tuple(env[o] for o in graph.outputs)
    return result[0] if graph.single_output else result


def dim_sizes(graph: LayerGraph, env: Mapping[str, torch.Tensor]) -> dict[object, int]:
    """The size of each of ``graph``'s dynamic dimensions, read from the values in ``env``."""
    return {sym: int(env[name].shape[axis]) for sym, (name, axis) in graph.dims.items()}


def evaluate_node(
    node: Node, args: Sequence[torch.Tensor], dims: dict[object, int]
) -> tuple[torch.Tensor, ...]:
    """The outputs of one layer operator on ``args`` (``dims``: :func:`dim_sizes`)."""
    op = node.op
    if isinstance(op, L.Reshape):
        return (args[0].reshape(_concrete(op.shape, dims)),)
    if isinstance(op, L.Arange):
        start, end = _concrete([op.start, op.end], dims)
        return (torch.arange(start, end, dtype=torch.int64),)
    if isinstance(op, L.Slice):
        start, end = _concrete([op.start, op.end], dims)
        return (args[0].narrow(op.dim, start, end - start),)
    if isinstance(op, Repeat):
        return evaluate_repeat(op, args)
    return EVALUATORS[type(op)](op, args)
