"""Causal (prefill) grouped-query attention as a STeP graph: ``S`` new query tokens per
request over ragged KV caches, an online softmax per query tile (STeP (arXiv 2511.07776)
§5.1 "FlashAttention implementation", §3 operators; ragged dimensions as in decode).

Layout (row-major, as the layer graph stores them): ``q, out: [B*Hq*S, D]`` (both
``[B, Hq, S, D]``), caches ``k_cache, v_cache: [B*Hkv*Lmax, D]`` (``[B, Hkv, Lmax, D]``) whose
last ``S`` rows of each request hold the new tokens, ``kv_len: [B, 1]``.  Query token ``i``
of request ``b`` and head ``h`` sees KV head ``h // G`` rows ``j < n_b`` (its cached
prefix) and the new rows ``Lmax - S + u`` for ``u <= i`` (causal; every ``u < S`` when
``causal=False``).  A query that sees no key gives 0.

Structure, per (request, KV head) — the ``G = Hq/Hkv`` query heads and all ``S`` query
tokens of a group share each KV load, so every KV row is read once:

1. **Tile addresses in the graph.** ``kv_len`` is read once and repeated per KV head
   (``[1, B, Hkv]``); a Scan(``prefill_kv_cursor``) turns it into ``[row_base, n_b, Lmax, S]``
   and FlatMap(``kv_tiles_prefill``) cuts the cached prefix (``n_b`` rows) and the ``S`` new
   rows into ``(row, r, [u0, S])`` tiles of at most ``tile_kv`` rows, never across the
   segment boundary (``u0``: the tile's first new-token index, ``-1`` in the prefix).
2. **Tile loads.** RandomOffChipLoadRows reads each ``[r, D]`` K and V tile in one
   contiguous off-chip access.
3. **Online softmax.** The ``[G*S, D]`` query tile (heads ``kvh*G ..`` of every token: rows
   ``(b*Hkv + kvh)*G*S + g*S + i``, contiguous ``[1, D]`` rows packed by
   Accum(``retile_row``)) is expanded along the KV tiles; Accum(``online_softmax_causal``)
   keeps the running (max, sum, output), masking inside a tile of new rows the rows
   ``u0 + j > i`` token ``i`` may not see (plain ``online_softmax`` when not causal);
   Map(``softmax_finalize``) divides and FlatMap(``retile_streamify``) splits the result
   into rows, stored linearly (they are in ``out``'s row order).

Off-chip traffic (bytes, itemsize ``s``): ``q`` and ``out`` ``2 * B*Hq*S*D*s``, ``kv_len``
``8B``, and ``K`` + ``V`` ``2 * D*s * Hkv * sum_b (n_b + S)``: each row once per KV head.
The masked part of a tile of new rows is computed and discarded (the FLOPs count the whole
tile), the price of reading KV once.
"""

from __future__ import annotations

import math

import sympy as sp
import torch

from torch2step.errors import StepTypeError
from torch2step.step import Graph, OffChipTensor, Program, dyn, fn, zeros
from torch2step.step import fn_library_prefill as _fn_library_prefill  # noqa: F401

from .gqa import check_attention_tensors

__all__ = ["add_gqa_prefill", "gqa_prefill_graph", "gqa_prefill_reference"]


def add_gqa_prefill(
    g: Graph,
    *,
    q: OffChipTensor,
    k_cache: OffChipTensor,
    v_cache: OffChipTensor,
    kv_len: OffChipTensor,
    out: OffChipTensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: bool = True,
    tile_kv: int = 64,
    prefix: str = "attn",
) -> None:
    """Add prefill GQA to ``g`` (see the module docstring).  ``B`` is ``kv_len``'s row
    count, ``S = q rows / (B * Hq)`` and ``Lmax = k_cache rows / (B * Hkv)``; all may be
    symbolic, so one graph serves every batch, prompt length and cache length."""
    Hq, Hkv, D = num_q_heads, num_kv_heads, int(head_dim)
    if Hkv < 1 or Hq % Hkv:
        raise StepTypeError(f"add_gqa_prefill: num_q_heads={Hq} must be a multiple of {Hkv}")
    if tile_kv < 1:
        raise StepTypeError(f"add_gqa_prefill: tile_kv={tile_kv} must be >= 1")
    G, B = Hq // Hkv, kv_len.shape[0]
    S = sp.simplify(q.shape[0] / (B * Hq))
    Lmax = sp.simplify(k_cache.shape[0] / (B * Hkv))
    check_attention_tensors(
        "add_gqa_prefill",
        (
            (q, (B * Hq * S, D)),
            (out, (B * Hq * S, D)),
            (k_cache, (B * Hkv * Lmax, D)),
            (v_cache, (B * Hkv * Lmax, D)),
            (kv_len, (B, 1)),
        ),
        kv_len,
        "q/out [B*Hq*S, D], k_cache/v_cache [B*Hkv*Lmax, D], kv_len [B, 1] integer",
    )
    p = prefix

    lens = g.linear_load(kv_len, (1, 1), out_shape=(B,), stride=(1,), name=f"{p}_len")
    per_head = g.repeat(lens, Hkv, name=f"{p}_len_h")  # [1, B, Hkv]
    cursor = g.scan(
        per_head,
        "prefill_kv_cursor",
        fn("int_row", values=(-Lmax, 0, Lmax, S)),
        2,
        name=f"{p}_cursor",
    )  # [1, B, Hkv] of [row_base, n_b, Lmax, S]
    one = g.repeat(cursor, 1, name=f"{p}_cursor1")
    tiles = g.flat_map(one, fn("kv_tiles_prefill", tile=tile_kv), name=f"{p}_tiles")
    spans = g.zip(
        g.map(fn("get", index=0), tiles, name=f"{p}_tile_row"),
        g.map(fn("get", index=1), tiles, name=f"{p}_tile_rows"),
        name=f"{p}_kv_addr",
    )  # [1, B, Hkv, C] of (row, r)
    k_t = g.random_load_rows(spans, k_cache, tile_kv, name=f"{p}_k")  # [r, D]
    v_t = g.random_load_rows(spans, v_cache, tile_kv, name=f"{p}_v")

    q_rows = g.linear_load(
        q, (1, D), out_shape=(B, Hkv, G * S), stride=(Hkv * G * S, G * S, 1), name=f"{p}_q"
    )  # [1, B, Hkv, G*S] of [1, D]: heads kvh*G.., every token (contiguous rows)
    q_t = g.accum(q_rows, "retile_row", zeros(0, D, q.dtype), 1, name=f"{p}_q_tile")
    q_e = g.expand(g.repeat(q_t, 1, name=f"{p}_q1"), spans, 0, name=f"{p}_q_kv")
    init = fn("online_softmax_init", rows=G * S, cols=D, dtype=q.dtype)
    if causal:
        meta = g.map(fn("get", index=2), tiles, name=f"{p}_tile_mask")
        qkv = g.zip(q_e, k_t, v_t, meta, name=f"{p}_qkv")
        step = fn("online_softmax_causal", scale=float(scale))
    else:
        qkv = g.zip(q_e, k_t, v_t, name=f"{p}_qkv")
        step = fn("online_softmax", scale=float(scale))
    state = g.accum(qkv, step, init, 1, name=f"{p}_softmax")
    res = g.map("softmax_finalize", state, name=f"{p}_o")  # [1, B, Hkv] of [G*S, D]
    rows = g.flat_map(res, fn("retile_streamify", rows=1), name=f"{p}_o_rows")
    g.linear_store(rows, out, name=f"{p}_store")  # rows in the order of out


def gqa_prefill_graph(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str = "fp32",
    **kw: object,
) -> Program:
    """A verified program holding only prefill GQA over the dynamic sizes ``B``, ``S``,
    ``Lmax``; tensors ``q, k_cache, v_cache, kv_len, out``; ``scale`` defaults to
    ``1/sqrt(head_dim)``; other ``kw`` go to :func:`add_gqa_prefill`."""
    B, S, Lmax = dyn("B"), dyn("S"), dyn("Lmax")
    Hq, Hkv, D = num_q_heads, num_kv_heads, head_dim
    kw.setdefault("scale", 1.0 / math.sqrt(D))
    g = Graph("gqa_prefill")
    tensors = {
        "q": g.tensor("q", (B * Hq * S, D), dtype),
        "k_cache": g.tensor("k_cache", (B * Hkv * Lmax, D), dtype),
        "v_cache": g.tensor("v_cache", (B * Hkv * Lmax, D), dtype),
        "kv_len": g.tensor("kv_len", (B, 1), "int64"),
        "out": g.tensor("out", (B * Hq * S, D), dtype),
    }
    add_gqa_prefill(
        g,
        **tensors,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        **kw,  # type: ignore[arg-type]
    )
    return g.build()


def gqa_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Prefill GQA in plain PyTorch with an explicit mask; ``q: [B, Hq, S, D]``, caches
    ``[B, Hkv, Lmax, D]``, ``kv_len: [B]``; returns ``[B, Hq, S, D]``."""
    B, Hq, S, _ = q.shape
    Lmax = k_cache.shape[2]
    G = Hq // num_kv_heads
    k = k_cache.repeat_interleave(G, dim=1)
    v = v_cache.repeat_interleave(G, dim=1)
    j = torch.arange(Lmax)
    i = torch.arange(S)[:, None]
    new = (j >= Lmax - S) & ((j <= Lmax - S + i) if causal else torch.ones(S, 1, dtype=bool))
    visible = (j[None, None, :] < kv_len.reshape(B, 1, 1)) | new[None]  # [B, S, Lmax]
    scores = torch.einsum("bhsd,bhld->bhsl", q, k) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    w = torch.nan_to_num(torch.softmax(scores, dim=-1))
    return torch.einsum("bhsl,bhld->bhsd", w, v)
