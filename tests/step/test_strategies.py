"""Compile strategies of STeP (arXiv 2511.07776) §5 on small MoE layers: static vs dynamic
tiling (§5.2) equal PyTorch and pad exactly as specified; timing-only runs (values that steer
control computed, the rest shaped) give the same traffic, FLOPs and simulated cycles as full
runs; a store override replaces a stored value but not the store."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch2step.lower.blocks.moe import moe_graph, moe_inputs, moe_reference
from torch2step.spatial import simulate_graph
from torch2step.step import run
from torch2step.step.ops_compute import Accum, Map
from torch2step.step.timing_only import control_nodes

E, K, H, I, T = 4, 2, 16, 32, 9  # noqa: E741 - the layer's names
ROUTING = np.stack([np.zeros(T, np.int64), np.arange(T) % 2 + 1], axis=1)  # expert 3: no tokens
COUNTS = np.bincount(ROUTING.ravel(), minlength=E)  # [9, 5, 4, 0]


def _case(static_tile: int | None, tile_i: int = 8, repeat_tile: bool = False):
    kw = {"num_experts": E, "top_k": K, "hidden": H, "intermediate": I}
    g = moe_graph(**kw, tokens=T, tile_i=tile_i, static_tile=static_tile, repeat_tile=repeat_tile)
    return g, moe_inputs(**kw, tokens=T, routing=ROUTING)


@pytest.mark.parametrize("repeat_tile", [False, True])
@pytest.mark.parametrize("tile", [None, 1, 2, 4, 16])
def test_static_and_dynamic_tiling_equal_pytorch(tile: int | None, repeat_tile: bool) -> None:
    g, ins = _case(tile, repeat_tile=repeat_tile)
    res = run(g, tensors=ins)
    got = torch.as_tensor(np.asarray(res.tensors["out"]))
    torch.testing.assert_close(got, moe_reference(**ins), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tile", [None, 1, 2, 4, 16])
def test_static_tiling_reads_weights_once_per_tile(tile: int | None) -> None:
    """Off-chip bytes = activations + sum_e ceil(N_e / N) * 3 I H * 4 (§4.1, §5.2); dynamic
    tiling reads each used expert once; the run's bytes equal the §4.1 formula."""
    from torch2step.step.metrics import metrics

    g, ins = _case(tile)
    res = run(g, tensors=ins)
    tiles = [(1 if n else 0) if tile is None else math.ceil(n / tile) for n in COUNTS]
    acts = 2 * T * H * 4 + T * K * (8 + 4)  # x, out; topk_idx (int64), topk_w
    assert res.offchip_bytes == acts + sum(tiles) * 3 * I * H * 4
    assert int(metrics(g).evaluate(res.bindings)["offchip_bytes"]) == res.offchip_bytes


def test_static_tiling_computes_on_padded_rows() -> None:
    g, ins = _case(4)
    res = run(g, tensors=ins)
    dyn_g, _ = _case(None)
    dyn = run(dyn_g, tensors=ins)
    assert res.total_flops > dyn.total_flops  # 12 + 8 + 4 rows instead of 9 + 5 + 4


def test_control_cone_holds_selectors_not_matmuls() -> None:
    g, _ = _case(None)
    keep = control_nodes(g)
    assert "moe_sel" in keep and "moe_idx_ld" in keep
    mm = [
        op.name
        for op in g.nodes
        if isinstance(op, (Map, Accum)) and op.fn.name.startswith("matmul")
    ]
    assert mm and not keep & set(mm)


def test_control_cone_of_lanes_follows_only_the_token_ids() -> None:
    """Time-multiplexed expert lanes zip each result row with its token id, merge the lanes
    and unzip the ids to route the next step: only the ids member steers control, so no lane
    matmul is in the cone (only the router's), and the timing-only run times like the full
    run (same bindings, FLOPs and simulated cycles)."""
    import torch2step
    from models import get_layer

    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(
        spec.module,
        spec.example_inputs,
        chip="step-sda",
        dynamic_shapes=spec.dynamic_shapes,
        moe_lanes=2,
    )
    lw = prog.lowered
    g = lw.program
    keep = control_nodes(g)
    mm = {
        op.name
        for op in g.nodes
        if isinstance(op, (Map, Accum)) and op.fn.name.startswith("matmul")
    }
    lanes = {n for n in mm if "moeexperts" in n}
    assert lanes and not keep & lanes and len(keep & mm) == 1  # the router's logits
    assert any(isinstance(op, Map) and op.fn.name == "get" and op.name in keep for op in g.nodes)
    tensors, env = lw.feed(tuple(spec.example_inputs))
    full = run(g, tensors=tensors, env=env)
    fast = run(g, tensors=tensors, env=env, timing_only=True)
    assert dict(fast.bindings) == dict(full.bindings) and fast.flops == full.flops
    a = simulate_graph(g, "step-sda", full)
    b = simulate_graph(g, "step-sda", fast)
    assert a.cycles == b.cycles and a.units == b.units


@pytest.mark.parametrize("tile", [None, 4])
def test_timing_only_run_times_like_the_full_run(tile: int | None) -> None:
    g, ins = _case(tile, repeat_tile=tile is None)
    full = run(g, tensors=ins)
    fast = run(g, tensors=ins, timing_only=True)
    assert fast.offchip_bytes == full.offchip_bytes
    assert fast.flops == full.flops and fast.onchip_bytes == full.onchip_bytes
    assert dict(fast.bindings) == dict(full.bindings)
    a = simulate_graph(g, "step-sda", full)
    b = simulate_graph(g, "step-sda", fast)
    assert a.cycles == b.cycles and a.hbm_bytes == b.hbm_bytes and a.units == b.units


def test_store_override_replaces_the_value_not_the_store() -> None:
    from torch2step.step import Graph

    g = Graph("copy")
    src = g.tensor("src", (4, 8), "fp32")
    dst = g.tensor("dst", (4, 8), "fp32")
    g.linear_store(g.linear_load(src, (1, 8), out_shape=(4,), stride=(1,)), dst)
    prog = g.build()
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    other = -x
    plain = run(prog, tensors={"src": x})
    res = run(prog, tensors={"src": x}, store_overrides={"dst": other})
    np.testing.assert_array_equal(res.tensors["dst"], other)
    assert res.write_bytes == plain.write_bytes and res.read_bytes == plain.read_bytes
