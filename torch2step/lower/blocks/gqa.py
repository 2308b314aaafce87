"""Grouped-query attention in decode as a STeP graph: an online softmax over ragged KV caches
(STeP §5.1 "FlashAttention implementation", §5.4; STeP (revised) §3.1 ragged dimensions).

One new query token per request ``b``: ``q: [B*Hq, D]`` (row ``b*Hq + h``), caches
``k_cache, v_cache: [B*Hkv*Lmax, D]`` viewed row-major as ``[B, Hkv, Lmax, D]``,
``kv_len: [B, 1]`` the KV length ``n_b`` of each request.  Query head ``h`` attends KV head
``h // G`` (``G = Hq/Hkv``) over rows ``j < n_b`` plus the last ``tail_rows`` rows of its
``Lmax`` rows (tokens appended at the end of a padded cache);
``out = softmax(q k^T * scale) v`` over those rows, 0 for a row that sees no key.

Structure, per (request, KV head) — the ``G`` query heads of a group share one KV load
(that is what GQA saves):

1. **Tile addresses in the graph.** ``kv_len`` is read once (``[1, B]``) and repeated per
   KV head (``[1, B, Hkv]``).  A Scan (``kv_cursor``, initial state ``int_row(-Lmax, 0,
   Lmax)``) turns the lengths into ``[row_base, n_b, Lmax]`` with
   ``row_base = (b*Hkv + kvh) * Lmax``; FlatMap(``kv_tiles``) cuts the request's two row
   segments (rows ``[0, n_b)`` and its ``tail_rows`` last rows) into ``(row, r)`` runs of at
   most ``tile_kv`` consecutive rows, never across a segment boundary: a ragged dimension
   ``C[b, kvh]`` of KV tiles learnt from the data.  Nothing padded exists.
2. **Tile loads.** RandomOffChipLoadRows reads each run as one ``[r, D]`` tile of ``k_cache``
   and of ``v_cache`` (one contiguous ``r*D*itemsize``-byte access each); both tiles carry
   the row count of their shared address, so the last, partial tile of a segment is
   neither padded nor masked.
3. **Online softmax.** The ``[G, D]`` query tile of the group (one LinearOffChipLoad) is
   expanded along the request's KV tiles; Accum(``online_softmax``) keeps the running
   (max, sum, output) state (FlashAttention) and Map(``softmax_finalize``) divides; the
   ``[G, D]`` results are stored row-block by row-block into ``out``.

Off-chip traffic (bytes, itemsize ``s``): ``q`` and ``out`` ``2 * B*Hq*D*s``, ``kv_len``
``8B``, and ``K`` + ``V`` ``2 * D*s * sum_{b,kvh} (n_b + tail_rows)`` — exactly the rows used.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import sympy as sp
import torch

from torch2step.errors import StepTypeError
from torch2step.step import Graph, OffChipTensor, Program, Value, dyn, fn

from .gqa_regions import add_lane_attention, add_region_attention

__all__ = ["add_gqa_decode", "gqa_decode_graph", "gqa_inputs", "gqa_reference"]


def _same(a: sp.Expr, b: sp.Expr) -> bool:
    return sp.simplify(a - b) == 0


def check_attention_tensors(
    who: str,
    expected: tuple[tuple[OffChipTensor, tuple[sp.Expr, ...]], ...],
    kv_len: OffChipTensor,
    layout: str,
) -> None:
    """Raise :class:`StepTypeError` naming every tensor whose shape is not its expected 2-D
    ``[rows, cols]`` (symbolically equal), or ``kv_len`` when it is not an integer tensor."""
    bad = [
        t
        for t, shape in expected
        if len(t.shape) != 2 or not all(_same(a, b) for a, b in zip(t.shape, shape))
    ]
    if bad or kv_len.dtype not in ("int32", "int64"):
        raise StepTypeError(
            f"{who}: tensors {', '.join(str(t) for t in bad) or str(kv_len)} do not fit {layout}"
        )


def add_gqa_decode(
    g: Graph,
    *,
    q: OffChipTensor,
    k_cache: OffChipTensor,
    v_cache: OffChipTensor,
    kv_len: OffChipTensor,
    out: OffChipTensor,
    num_q_heads: int,
    num_kv_heads: int,
    scale: float,
    tail_rows: int = 0,
    tile_kv: int = 64,
    prefix: str = "attn",
    regions: int | None = None,
    region: OffChipTensor | None = None,
    lanes: int = 1,
) -> None:
    """Add decode GQA to ``g`` (see the module docstring).  ``B`` is ``kv_len``'s row count
    and ``Lmax = k_cache rows / (B * Hkv)``; both may be symbolic.  ``regions=R`` with
    ``region: [B, 1]`` (each request's region) parallelises the requests over ``R`` regions
    (STeP (arXiv 2511.07776) §5.4, :mod:`torch2step.lower.blocks.gqa_regions`); otherwise
    ``lanes=P > 1`` spreads the (request, KV head) items over ``P`` pipelines, balanced by
    their KV rows (:func:`~torch2step.lower.blocks.gqa_regions.add_lane_attention`)."""
    Hq, Hkv = num_q_heads, num_kv_heads
    if Hkv < 1 or Hq % Hkv:
        raise StepTypeError(f"add_gqa_decode: num_q_heads={Hq} must be a multiple of {Hkv}")
    if tile_kv < 1 or tail_rows < 0 or lanes < 1:
        raise StepTypeError(
            f"add_gqa_decode: needs tile_kv={tile_kv} >= 1, tail_rows={tail_rows} >= 0 and "
            f"lanes={lanes} >= 1"
        )
    G, B, D = Hq // Hkv, kv_len.shape[0], q.shape[1]
    if not D.is_Integer:
        raise StepTypeError(f"add_gqa_decode: the head dim of {q} must be static")
    Lmax = sp.simplify(k_cache.shape[0] / (B * Hkv))
    check_attention_tensors(
        "add_gqa_decode",
        (
            (q, (B * Hq, D)),
            (out, (B * Hq, D)),
            (k_cache, (B * Hkv * Lmax, D)),
            (v_cache, (B * Hkv * Lmax, D)),
            (kv_len, (B, 1)),
        ),
        kv_len,
        "q/out [B*Hq, D], k_cache/v_cache [B*Hkv*Lmax, D], kv_len [B, 1] integer",
    )
    p, D = prefix, int(D)

    def cursors(p: str) -> Value:  # [1, B, Hkv] of [row_base, n_b, Lmax]
        lens = g.linear_load(kv_len, (1, 1), out_shape=(B,), stride=(1,), name=f"{p}_len")
        per_head = g.repeat(lens, Hkv, name=f"{p}_len_h")  # [1, B, Hkv]
        init = fn("int_row", values=(-Lmax, 0, Lmax))
        return g.scan(per_head, "kv_cursor", init, 2, name=f"{p}_cursor")

    def load_q() -> Value:
        return g.linear_load(q, (G, D), out_shape=(B, Hkv), stride=(Hkv, 1), name=f"{p}_q")

    def attend(g: Graph, cursor: Value, q_t: Value | Callable[[], Value], p: str) -> Value:
        return _attend(
            g, cursor, q_t, k_cache, v_cache, G=G, D=D, dtype=q.dtype, scale=scale,
            tail_rows=tail_rows, tile_kv=tile_kv, p=p,
        )

    if regions is None and lanes > 1:
        add_lane_attention(
            g, cursors=cursors, q=q, group=G, lanes=lanes, tail_rows=tail_rows, out=out,
            attend=attend, prefix=p,
        )
        return
    cursor = cursors(p)
    if regions is None:
        g.linear_store(attend(g, cursor, load_q, p), out, name=f"{p}_store")
        return
    if region is None or not 1 <= regions:
        raise StepTypeError(
            f"add_gqa_decode: regions={regions} needs a positive count and a region tensor"
        )
    add_region_attention(
        g, cursor=cursor, q_tiles=load_q(), region=region, regions=regions, out=out,
        attend=attend, prefix=p,
    )


def _attend(
    g: Graph,
    cursor: Value,
    q_t: Value | Callable[[], Value],
    k_cache: OffChipTensor,
    v_cache: OffChipTensor,
    *,
    G: int,
    D: int,
    dtype: str,
    scale: float,
    tail_rows: int,
    tile_kv: int,
    p: str,
) -> Value:
    """Steps 1-4 of the module docstring from the request cursors and ``[G, D]`` query tiles
    (streams of one shape ``[.., Hkv]``; a callable loads them where they are needed) to the
    ``[G, D]`` results of that shape."""
    one = g.repeat(cursor, 1, name=f"{p}_cursor1")
    spans = g.flat_map(
        one, fn("kv_tiles", tail=tail_rows, tile=tile_kv), name=f"{p}_kv_addr"
    )  # [.., Hkv, C] of (row, r)
    k_t = g.random_load_rows(spans, k_cache, tile_kv, name=f"{p}_k")  # [r, D]
    v_t = g.random_load_rows(spans, v_cache, tile_kv, name=f"{p}_v")
    q_v = q_t() if callable(q_t) else q_t
    # expanded along the (small) tile addresses, not the K tiles: no second copy of K moves
    q_e = g.expand(g.repeat(q_v, 1, name=f"{p}_q1"), spans, 0, name=f"{p}_q_kv")
    state = g.accum(
        g.zip(q_e, k_t, v_t, name=f"{p}_qkv"),
        fn("online_softmax", scale=float(scale)),
        fn("online_softmax_init", rows=G, cols=D, dtype=dtype),
        1,
        name=f"{p}_softmax",
    )  # [.., Hkv] of (max, sum, out)
    return g.map("softmax_finalize", state, name=f"{p}_o")  # [.., Hkv] of [G, D]


# ---------------------------------------------------------------- convenience


def gqa_decode_graph(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int | sp.Expr | None = None,
    max_len: int | sp.Expr | None = None,
    dtype: str = "fp32",
    **kw: object,
) -> Program:
    """A verified program holding only decode GQA; tensors ``q, k_cache, v_cache, kv_len,
    out`` (and ``region: [B, 1]`` with ``regions=R``); ``batch`` / ``max_len`` default to the
    dynamic sizes ``B`` / ``Lmax``; ``scale`` defaults to ``1/sqrt(head_dim)``; other ``kw`` go
    to :func:`add_gqa_decode`."""
    B = dyn("B") if batch is None else batch
    Lmax = dyn("Lmax") if max_len is None else max_len
    Hq, Hkv, D = num_q_heads, num_kv_heads, head_dim
    kw.setdefault("scale", 1.0 / math.sqrt(D))
    g = Graph("gqa_decode")
    tensors = {
        "q": g.tensor("q", (B * Hq, D), dtype),
        "k_cache": g.tensor("k_cache", (B * Hkv * Lmax, D), dtype),
        "v_cache": g.tensor("v_cache", (B * Hkv * Lmax, D), dtype),
        "kv_len": g.tensor("kv_len", (B, 1), "int64"),
        "out": g.tensor("out", (B * Hq, D), dtype),
    }
    if kw.get("regions") is not None:
        tensors["region"] = g.tensor("region", (B, 1), "int64")
    add_gqa_decode(g, **tensors, num_q_heads=Hq, num_kv_heads=Hkv, **kw)  # type: ignore[arg-type]
    return g.build()


def gqa_inputs(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int,
    max_len: int,
    kv_lens: list[int] | np.ndarray | None = None,
    tail_rows: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random fp32 ``q``/caches and ``kv_len`` for :func:`gqa_decode_graph` (``run(tensors=)``).

    ``kv_lens`` (e.g. ``models.traces.kv_lengths(...)``, clipped to the cache) fixes the
    lengths; otherwise they are uniform in ``0 .. max_len - tail_rows``.
    """
    B, Hq, Hkv, D = batch, num_q_heads, num_kv_heads, head_dim
    gen = torch.Generator().manual_seed(seed)
    if kv_lens is None:
        lens = torch.randint(0, max_len - tail_rows + 1, (B,), generator=gen)
    else:
        lens = torch.as_tensor(np.asarray(kv_lens), dtype=torch.int64)
    if lens.shape != (B,) or int(lens.min()) < 0 or int(lens.max()) > max_len - tail_rows:
        raise ValueError(
            f"gqa_inputs: kv_lens {lens.tolist()} must be {B} values in 0..{max_len - tail_rows}"
        )
    return {
        "q": torch.randn(B * Hq, D, generator=gen),
        "k_cache": torch.randn(B * Hkv * max_len, D, generator=gen),
        "v_cache": torch.randn(B * Hkv * max_len, D, generator=gen),
        "kv_len": lens.reshape(B, 1).to(torch.int64),
    }


def gqa_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    scale: float,
    tail_rows: int = 0,
) -> torch.Tensor:
    """Decode GQA in plain PyTorch (per request: the used rows of its cache, grouped heads)."""
    B, D = kv_len.shape[0], q.shape[1]
    Hq, Hkv = num_q_heads, num_kv_heads
    Lmax = k_cache.shape[0] // (B * Hkv)
    k = k_cache.reshape(B, Hkv, Lmax, D)
    v = v_cache.reshape(B, Hkv, Lmax, D)
    qh = q.reshape(B, Hq, D)
    out = torch.zeros_like(qh)
    for b in range(B):
        n = int(kv_len[b, 0])
        rows = torch.cat([torch.arange(n), torch.arange(Lmax - tail_rows, Lmax)])
        if rows.numel() == 0:
            continue
        kb = k[b][:, rows].repeat_interleave(Hq // Hkv, dim=0)  # [Hq, R, D]
        vb = v[b][:, rows].repeat_interleave(Hq // Hkv, dim=0)
        scores = torch.einsum("hd,hrd->hr", qh[b], kb) * scale
        out[b] = torch.einsum("hr,hrd->hd", torch.softmax(scores, dim=-1), vb)
    return out.reshape(B * Hq, D)
