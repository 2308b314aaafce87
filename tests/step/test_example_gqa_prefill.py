"""Prefill GQA as a STeP graph (causal and not, ragged KV lengths including 0 and 1): one
program for every batch, prompt length and cache length equals a masked PyTorch softmax, and
its off-chip traffic equals the closed form (only the visible KV rows are read)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch2step.lower.blocks.attention_prefill import gqa_prefill_graph, gqa_prefill_reference
from torch2step.step import StepRuntimeError, metrics, run

HQ, HKV, D = 4, 2, 8


@pytest.fixture(scope="module", params=[True, False])
def prog(request):
    return request.param, gqa_prefill_graph(
        num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, tile_kv=4, causal=request.param
    )


def _run(prog, q, k, v, lens):
    b, _, s, _ = q.shape
    res = run(
        prog,
        tensors={
            "q": q.reshape(-1, D),
            "k_cache": k.reshape(-1, D),
            "v_cache": v.reshape(-1, D),
            "kv_len": lens.reshape(b, 1),
        },
        env={"S": s},
    )
    return res, torch.as_tensor(np.asarray(res.tensors["out"])).reshape(q.shape)


@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 3),
    s=st.integers(1, 9),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_pytorch(prog, b: int, s: int, extra: int, seed: int) -> None:
    causal, program = prog
    gen = torch.Generator().manual_seed(seed)
    length = s + extra
    lens = torch.randint(0, extra + 1, (b,), generator=gen)
    lens[0] = min(1, extra)
    q = torch.randn(b, HQ, s, D, generator=gen)
    k = torch.randn(b, HKV, length, D, generator=gen)
    v = torch.randn(b, HKV, length, D, generator=gen)
    res, got = _run(program, q, k, v, lens)
    want = gqa_prefill_reference(
        q, k, v, lens, num_kv_heads=HKV, scale=1 / math.sqrt(D), causal=causal
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # §4.1 traffic: q and out, the lengths, and each K and V row a request sees (its prefix
    # and the s new rows) once per KV head: every query token of the group shares the tiles
    rows = HKV * sum(int(n) + s for n in lens)
    assert res.offchip_bytes == 2 * b * HQ * s * D * 4 + 8 * b + 2 * rows * D * 4
    assert metrics(program).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes


def test_too_long_cache_length_is_a_clear_error(prog) -> None:
    _, program = prog
    q, k = torch.randn(1, HQ, 3, D), torch.randn(1, HKV, 4, D)
    with pytest.raises(StepRuntimeError, match="KV length 2 must lie in 0..1"):
        _run(program, q, k, k, torch.tensor([2]))
