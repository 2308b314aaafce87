"""ELK operators of the registered layers at full size, from their configurations alone (no
weights): the single attention and MoE layers of :mod:`models` and whole decode steps of
:mod:`elk.ops`."""

from __future__ import annotations

from typing import Any

import numpy as np

from elk.ops import Operator, expected_active, expert_rows, routed_expert_ops
from models.configs import AttentionConfig, MoEConfig
from models.registry import LAYERS
from torch2step.errors import LoweringError

__all__ = ["moe_active", "registered_layer_ops"]


def _attention(cfg: AttentionConfig, batch: int, kv_len: int, dtype: str) -> list[Operator]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    spec = [
        ("qkv_proj", "matmul", (batch, h, q + 2 * kv), 0),
        ("rotary", "vector", (batch, q + kv), 6 if cfg.qk_norm else 3),
        ("attention", "attention", (batch, cfg.num_heads, cfg.num_kv_heads, d, kv_len), 0),
        ("o_proj", "matmul", (batch, q, h), 0),
    ]
    return [
        Operator(name, kind, dims, dtype, slot=k, flops_per_elem=max(1, fpe))  # type: ignore[arg-type]
        for k, (name, kind, dims, fpe) in enumerate(spec)
    ]


def moe_active(cfg: MoEConfig, tokens: int, routing: Any = None) -> int:
    """Experts a batch of ``tokens`` selects: the distinct ids of ``routing`` (``[tokens,
    top_k]`` expert choices, e.g. a real trace), else their expected number under uniform
    routing, ``E (1 - (1 - k/E)^tokens)``."""
    return active_experts(cfg.num_experts, cfg.top_k, tokens, routing)


def active_experts(
    experts: int, top_k: int, tokens: int, routing: Any = None, where: str = "routing"
) -> int:
    """:func:`moe_active` of a layer with ``experts`` experts, ``top_k`` per token (``where``
    names it in errors)."""
    if routing is None:
        return expected_active(experts, top_k, tokens)
    ids = np.asarray(routing)
    if ids.shape != (tokens, top_k) or not np.issubdtype(ids.dtype, np.integer):
        raise LoweringError(
            f"{where} of shape {list(ids.shape)} ({ids.dtype}): expected [{tokens}, {top_k}] "
            "integer expert ids (tokens, top_k)"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= experts):
        raise LoweringError(
            f"{where}: expert ids {ids.min()}..{ids.max()}, the layer has {experts}"
        )
    return max(1, len(np.unique(ids)))


def _moe(cfg: MoEConfig, tokens: int, dtype: str, routing: Any = None) -> list[Operator]:
    """The router, its top-k and the active experts as grouped operators (each expert's rows
    those ``routing`` gives it, else an even share), whose weights are preloaded only once
    the top-k has executed (ELK §7 "Apply ELK to MoE": the routing selects them)."""
    e, k, h, i = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    active = moe_active(cfg, tokens, routing)
    counts = None if routing is None else expert_rows(routing, e)
    spec: list[tuple[str, str, tuple[int, ...], dict]] = [
        ("router", "matmul", (tokens, h, e), {}),
        ("topk", "vector", (tokens, e), {"flops_per_elem": 8}),
    ]
    # the active experts as grouped operators that each fit the chip, as in a decode step
    spec += routed_expert_ops(
        tokens, h, i, k, active, dtype, routed={"routed_by": "topk"}, counts=counts
    )
    return [
        Operator(
            name,
            kind,  # type: ignore[arg-type]
            dims,
            dtype,
            slot=n,
            **{"flops_per_elem": 1, **kw},
        )
        for n, (name, kind, dims, kw) in enumerate(spec)
    ]


def registered_layer_ops(
    name: str, batch: int, kv_len: int = 2048, dtype: str = "bf16", routing: Any = None
) -> list[Operator]:
    """Operators of registered layer ``name`` at full size (MoE: the experts ``routing``
    selects, ``[batch, top_k]`` expert ids, each with the rows routed to it, or without it the
    experts any of ``batch`` tokens selects in expectation under uniform routing, the
    selections spread evenly; see :func:`_moe`), in ``dtype`` (``bf16`` as served, ``fp16`` or
    ``fp32``)."""
    if name not in LAYERS:
        raise LoweringError(f"unknown layer {name!r}; valid names: {', '.join(LAYERS)}")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise LoweringError(f"dtype {dtype!r}: choose from bf16, fp16, fp32")
    cfg = LAYERS[name].config
    if isinstance(cfg, AttentionConfig):
        return _attention(cfg, batch, kv_len, dtype)
    if isinstance(cfg, MoEConfig):
        return _moe(cfg, batch, dtype, routing)
    raise LoweringError(f"layer {name!r} has no kernel-execution operator list")
