"""seed 000 Appendix A.2, Fig. 12: a Map with large A x B^T tiles rewritten into 16x16 tiles
with Bufferize / Repeat / Streamify and an Accum computes the same result."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from torch2step.step import Graph, RunResult, offchip_traffic, zeros


def _large() -> Graph:
    g = Graph("large")
    a, b, c = g.tensor("a", (64, 256)), g.tensor("b", (32, 256)), g.tensor("c", (64, 32))
    a_t = g.flatten(g.linear_load(a, (16, 256)), 0, 1)  # [1, 4] of [16, 256]
    b_t = g.linear_load(b, (32, 256), ref=a_t, out_shape=(1,), stride=(0,))  # [1, 4, 1]
    out = g.map("matmul_t", g.repeat(a_t, 1), b_t)  # [1, 4, 1] of [16, 32]
    g.linear_store(out, c)
    return g


def _small() -> Graph:
    g = Graph("small")
    a, b, c = g.tensor("a", (64, 256)), g.tensor("b", (32, 256)), g.tensor("c", (64, 32))
    a_buf = g.bufferize(g.linear_load(a, (16, 16)), 1)  # [1, 4] of Buf[16]
    a_s = g.streamify(a_buf, g.repeat(a_buf, 2))  # Repeat count=2: [1, 4, 2, 16]
    b_buf = g.bufferize(g.linear_load(b, (16, 16)), 2)  # [1] of Buf[2, 16]
    b_s = g.streamify(b_buf, a_buf)  # once per A row block: [1, 4, 2, 16]
    prod = g.map("matmul_t", a_s, b_s)  # [1, 4, 2, 16] of [16, 16]
    out = g.accum(prod, "add", zeros(16, 16), 1)  # [1, 4, 2] of [16, 16]
    g.linear_store(out, c)
    return g


def test_fig12_rewrite_preserves_meaning(
    checked_run: Callable[..., RunResult], rng: np.random.Generator
) -> None:
    A = rng.standard_normal((64, 256)).astype(np.float32)
    B = rng.standard_normal((32, 256)).astype(np.float32)
    large, small = _large().build(), _small().build()
    r_large = checked_run(large, tensors={"a": A, "b": B})
    r_small = checked_run(small, tensors={"a": A, "b": B})
    assert np.allclose(r_large.tensors["c"], A @ B.T, atol=1e-3)
    assert np.allclose(r_small.tensors["c"], A @ B.T, atol=1e-3)
    # the small-tile graph keeps B on chip: B is read once instead of once per A row block
    assert offchip_traffic(large) == 64 * 256 * 4 + 4 * 32 * 256 * 4 + 64 * 32 * 4
    assert offchip_traffic(small) == 64 * 256 * 4 + 32 * 256 * 4 + 64 * 32 * 4
    # same multiply-adds, plus the Accum's tile additions (16 per output tile, from zeros)
    assert r_small.total_flops == r_large.total_flops + 4 * 2 * 16 * 256
