"""ELK operators: what one ``execute`` call computes and what its ``preload_async`` reads.

An :class:`Operator` is a matrix product (``matmul``: ``M x K`` activations times a ``K x N``
weight preloaded from HBM), a decode attention (``attention``: a batch of queries against a
KV cache preloaded from HBM), or a row-wise vector operation (``vector``: norms, rotary
embedding, residual adds, SwiGLU gating, routing).  :func:`decode_step_ops` builds the operator
list of an N-layer decode step from published model configurations (shapes only: no weights
are needed to plan and time a full-size model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from elk.errors import ElkError

__all__ = [
    "Operator",
    "DecoderShape",
    "DECODERS",
    "decode_step_ops",
    "expert_groups",
    "expected_active",
    "expert_rows",
    "layer_ops",
    "routed_expert_ops",
    "input_on_chip",
]

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

#: Routed experts per operator in a decode step (a layer's active experts become a few
#: grouped operators, so each fits the chip and can be preloaded on its own).
EXPERTS_PER_OP = 32

#: Bytes of the gate and up weights of one grouped expert operator at most: the operator must
#: fit the chip with room left to preload the next (a quarter of an IPU-class chip's ~900 MB of
#: SRAM; for scale, one of Llama-3-8B's dense MLP projections, 4096 x 14336 in bf16, is 117 MB).
#: Qwen3-30B-A3B's experts (2 x 2048 x 768 in bf16, 6.3 MB) stay grouped by
#: :data:`EXPERTS_PER_OP`; one Mixtral-8x7B expert's gate and up (2 x 4096 x 14336, 235 MB) is
#: an operator of its own.
EXPERT_OP_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Operator:
    """One operator.  ``dims``: matmul ``(M, K, N)``; attention ``(B, Hq, Hkv, D, L)``; vector
    ``(R, C)`` rows x columns with ``flops_per_elem`` and ``param_bytes`` read from HBM (every
    core working on it reads the parameters).  ``layer``/``slot``: layer index and position in
    the layer.  ``tensors``: names of the HBM tensors the code generator binds (inputs, preloaded
    data, outputs); ``node``: the layer-graph node a vector operator evaluates (on one core);
    ``row_reduce``: a vector operator that reduces whole rows (norms, routing);
    ``routed_by``: the operator whose result selects what this one preloads (dynamic MoE);
    ``useful_flops``: the FLOPs its rows need when ``dims`` pad them (a grouped expert
    operator is timed at its busiest expert's rows, :func:`routed_expert_ops`; 0: ``dims``')."""

    name: str
    kind: Literal["matmul", "attention", "vector"]
    dims: tuple[int, ...]
    dtype: str = "bf16"
    layer: int = 0
    slot: int = 0
    flops_per_elem: int = 4
    param_bytes: int = 0
    tensors: tuple[tuple[str, str], ...] = field(default=())
    node: str | None = None
    row_reduce: bool = False
    routed_by: str | None = None
    useful_flops: int = 0

    @property
    def elem(self) -> int:
        return _BYTES[self.dtype]

    @property
    def hbm_bytes(self) -> int:
        """Bytes its preload reads from HBM (weights, KV cache, parameters)."""
        if self.kind == "matmul":
            _, k, n = self.dims
            return k * n * self.elem
        if self.kind == "attention":
            b, _, hkv, d, length = self.dims
            return 2 * b * hkv * length * d * self.elem
        return self.param_bytes

    @property
    def flops(self) -> int:
        """FLOPs of the computation (``useful_flops`` when given: padding rows excluded)."""
        if self.useful_flops:
            return self.useful_flops
        if self.kind == "matmul":
            m, k, n = self.dims
            return 2 * m * k * n
        if self.kind == "attention":
            b, hq, _, d, length = self.dims
            return 4 * b * hq * length * d
        r, c = self.dims
        return self.flops_per_elem * r * c

    def tensor(self, role: str) -> str:
        """The HBM tensor bound to ``role`` (``"x"``, ``"w"``, ``"y"``, ...)."""
        for r, name in self.tensors:
            if r == role:
                return name
        raise ElkError(f"operator {self.name!r} has no tensor for role {role!r}")


def _in_view(op: Operator) -> tuple[int, int]:
    """The input activation of ``op`` as a ``(rows, columns)`` matrix."""
    if op.kind == "matmul":
        return op.dims[0], op.dims[1]
    if op.kind == "attention":
        b, hq, _, d, _ = op.dims
        return b, hq * d
    return op.dims[0], op.dims[1]


def _out_view(op: Operator) -> tuple[int, int]:
    """The output activation of ``op`` as a ``(rows, columns)`` matrix."""
    if op.kind == "matmul":
        return op.dims[0], op.dims[2]
    return _in_view(op)


def input_on_chip(prev: Operator | None, op: Operator) -> bool:
    """Whether ``op`` gathers its input activation from the cores that produced it (ELK §4.5:
    activations stay on chip): its ``(rows, columns)`` view is the leading columns of the
    previous operator's output (the rotary step reads the query and key columns of the QKV
    projection).  Otherwise it reads it from HBM, where the relayout went (a layer's first
    operator, a routed expert group's rows)."""
    if prev is None or prev.dtype != op.dtype:
        return False
    (r0, c0), (r1, c1) = _out_view(prev), _in_view(op)
    return r0 == r1 and c1 <= c0


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The shapes of one decoder layer (published ``config.json`` numbers)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    experts: int = 0
    top_k: int = 0
    qk_norm: bool = False


DECODERS: dict[str, DecoderShape] = {
    # meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    # intermediate 14336, 32 layers.
    "llama3-8b": DecoderShape("llama3-8b", 4096, 32, 8, 128, 14336, 32),
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 32 heads, 4 KV heads, head_dim 128,
    # moe_intermediate_size 768, 128 experts, 8 per token, 48 layers, q/k RMSNorm.
    "qwen3-30b-a3b": DecoderShape(
        "qwen3-30b-a3b", 2048, 32, 4, 128, 768, 48, experts=128, top_k=8, qk_norm=True
    ),
}


def expert_groups(active: int, hidden: int, intermediate: int, dtype: str = "bf16") -> list[int]:
    """How many of the ``active`` routed experts each grouped operator takes, as evenly as
    possible: at most :data:`EXPERTS_PER_OP` experts, and no more than keep an operator's gate
    and up weights (``2 x hidden x intermediate`` elements of ``dtype`` per expert) within
    :data:`EXPERT_OP_BYTES` (at least one expert per operator)."""
    if dtype not in _BYTES:
        raise ElkError(f"dtype {dtype!r}: choose from {', '.join(_BYTES)}")
    per_expert = 2 * hidden * intermediate * _BYTES[dtype]
    per = max(1, min(EXPERTS_PER_OP, EXPERT_OP_BYTES // max(1, per_expert)))
    groups = math.ceil(active / per)
    return [active // groups + (1 if g < active % groups else 0) for g in range(groups)]


def expected_active(experts: int, top_k: int, tokens: int) -> int:
    """Experts a batch of ``tokens`` selects in expectation under uniform routing,
    ``E (1 - (1 - k/E)^tokens)`` (at least one)."""
    return max(1, round(experts * (1 - (1 - top_k / experts) ** tokens)))


def routed_expert_ops(
    tokens: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    active: int,
    dtype: str = "bf16",
    routed: dict | None = None,
    prefix: str = "",
    counts: Sequence[int] | None = None,
) -> list[tuple[str, str, tuple[int, ...], dict]]:
    """The ``active`` routed experts of a MoE layer as ``(name, kind, dims, fields)`` of
    grouped operators (:func:`expert_groups`; grouped GEMMs: every expert's weights meet the
    rows routed to it): per group its gate and up projections, the SwiGLU and the down
    projection.  ``counts``: the rows each active expert receives (a routing's; default: the
    ``tokens x top_k`` selections spread evenly).  The experts are grouped busiest first, so
    experts of like load share an operator; a group's matmuls are timed at its busiest
    expert's rows (its cores finish last) and count the FLOPs of the rows its experts
    receive (``useful_flops``).  ``routed``: fields of the two matmuls (dynamic MoE:
    ``routed_by``)."""
    if counts is None:
        sel = tokens * top_k
        counts = [sel // active + (1 if j < sel % active else 0) for j in range(active)]
    if len(counts) != active:
        raise ElkError(f"{len(counts)} expert row counts for {active} active experts")
    load = sorted((max(1, int(r)) for r in counts), reverse=True)
    mm = dict(routed or {})
    out: list[tuple[str, str, tuple[int, ...], dict]] = []
    at = 0
    for g, ng in enumerate(expert_groups(active, hidden, intermediate, dtype)):
        rows, total = load[at], sum(load[at : at + ng])
        at += ng
        gu = {**mm, "useful_flops": 2 * total * hidden * 2 * intermediate}
        dn = {**mm, "useful_flops": 2 * total * intermediate * hidden}
        out += [
            (f"{prefix}experts{g}_gate_up", "matmul", (rows, hidden, 2 * intermediate * ng), gu),
            (f"{prefix}experts{g}_act", "vector", (total, intermediate), {"flops_per_elem": 5}),
            (f"{prefix}experts{g}_down", "matmul", (rows, intermediate * ng, hidden), dn),
        ]
    return out


def expert_rows(ids: Any, experts: int) -> list[int]:
    """Rows each expert a routing selects receives: the nonzero counts of ``ids``
    (``[tokens, top_k]`` expert ids) over ``experts`` experts."""
    n = np.bincount(np.asarray(ids).reshape(-1), minlength=experts)
    return [int(r) for r in n if r]


def layer_ops(
    shape: DecoderShape, batch: int, kv_len: int, layer: int = 0, dynamic: bool = False
) -> list[Operator]:
    """The operators of one decode-step layer, in execution order.  ``dynamic``: the experts'
    weights are preloaded only once the routing (``topk``) has executed (ELK §7 "Apply ELK to
    MoE"): the planner sees a generic expert group of the expected active size and may not
    issue its preload earlier; experts no token picks are not in the list, so never loaded."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    ops: list[tuple[str, str, tuple[int, ...], dict]] = [
        ("attn_norm", "vector", (batch, h), {"row_reduce": True}),
        ("qkv_proj", "matmul", (batch, h, q + 2 * kv), {}),
        (
            "rotary",
            "vector",
            (batch, q + kv),
            # Qwen3 normalises q and k per head before the rotation: a reduction over head_dim
            {"flops_per_elem": 6, "row_reduce": True} if shape.qk_norm else {"flops_per_elem": 3},
        ),
        ("attention", "attention", (batch, shape.heads, shape.kv_heads, d, kv_len), {}),
        ("o_proj", "matmul", (batch, q, h), {}),
        ("attn_residual", "vector", (batch, h), {"flops_per_elem": 1}),
        ("mlp_norm", "vector", (batch, h), {"row_reduce": True}),
    ]
    if shape.experts:
        # Experts any of the ``batch`` tokens selects, in expectation under uniform routing;
        # each expert's rows are the tokens routed to it.
        e, k = shape.experts, shape.top_k
        routed = {"routed_by": f"L{layer}.topk"} if dynamic else {}
        ops += [
            ("router", "matmul", (batch, h, e), {}),
            ("topk", "vector", (batch, e), {"flops_per_elem": 8, "row_reduce": True}),
        ]
        # the active experts as a few grouped operators, then the weighted sum
        active = expected_active(e, k, batch)
        ops += routed_expert_ops(batch, h, shape.intermediate, k, active, routed=routed)
        ops.append(("experts_sum", "vector", (batch, h), {"flops_per_elem": 2 * k}))
    else:
        i = shape.intermediate
        # gate_proj and up_proj are two weights in the published models (HF LlamaMLP); as
        # separate operators each preloads on its own (ELK Table 2's operators are single
        # projections) and each fits a mesh's row-by-column grid
        ops += [
            ("gate", "matmul", (batch, h, i), {}),
            ("up", "matmul", (batch, h, i), {}),
            ("silu_mul", "vector", (batch, i), {"flops_per_elem": 5}),
            ("down", "matmul", (batch, i, h), {}),
        ]
    ops.append(("mlp_residual", "vector", (batch, h), {"flops_per_elem": 1}))
    return [
        Operator(f"L{layer}.{name}", kind, dims, layer=layer, slot=slot, **kw)  # type: ignore[arg-type]
        for slot, (name, kind, dims, kw) in enumerate(ops)
    ]


def decode_step_ops(
    model: str, batch: int, kv_len: int, layers: int | None = None, dynamic: bool = False
) -> list[Operator]:
    """Every operator of one decode step of ``model`` (a key of :data:`DECODERS`);
    ``dynamic``: routed experts preload after their routing (see :func:`layer_ops`)."""
    if model not in DECODERS:
        raise ElkError(f"unknown model {model!r}; choose one of {', '.join(DECODERS)}")
    shape = DECODERS[model]
    n = shape.layers if layers is None else layers
    out: list[Operator] = []
    for layer in range(n):
        out += layer_ops(shape, batch, kv_len, layer, dynamic)
    return out
