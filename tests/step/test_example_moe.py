"""The hand-built MoE graph (seed 000 Fig. 2, §5.2 dynamic tiling) against plain PyTorch.

Golden printed graphs live in tests/step/golden/; regenerate them with ``UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
import torch

from torch2step.errors import StepTypeError
from torch2step.lower.blocks import add_moe, default_tile, moe_graph, moe_inputs, moe_reference
from torch2step.step import Graph, RunResult, StepRuntimeError, dyn, metrics, run

GOLDEN = Path(__file__).parent / "golden"
E, K, H, I = 4, 2, 16, 8  # noqa: E741


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with golden/<name> (``UPDATE_GOLDEN=1`` rewrites the file)."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text + "\n" == path.read_text(), f"{name} differs; rerun with UPDATE_GOLDEN=1"


def _run(
    checked_run: Callable[..., RunResult],
    routing: np.ndarray,
    *,
    seed: int = 0,
    activation: str = "silu",
    tiles: tuple[int | None, int | None] = (8, 4),
) -> RunResult:
    prog = moe_graph(
        num_experts=E,
        top_k=routing.shape[1],
        hidden=H,
        intermediate=I,
        tile_h=tiles[0],
        tile_i=tiles[1],
        activation=activation,
    )
    inp = moe_inputs(
        num_experts=E,
        top_k=routing.shape[1],
        hidden=H,
        intermediate=I,
        tokens=routing.shape[0],
        seed=seed,
        routing=routing,
    )
    res = checked_run(prog, tensors=inp)  # every §4.1 formula == what the run counted
    ref = moe_reference(**inp, activation=activation)
    np.testing.assert_allclose(res.tensors["out"], ref.numpy(), atol=1e-4, rtol=0)
    assert metrics(prog).evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes
    return res


ROUTINGS = {
    "random": None,
    "expert_3_unused": np.array([[0, 1], [2, 1], [1, 0], [0, 2], [2, 0]]),
    "all_to_experts_0_3": np.array([[3, 0]] * 6),
    "one_token": np.array([[2, 1]]),
}


@pytest.mark.parametrize("tiles", [(8, 4), (None, None)], ids=["tiled", "whole"])
@pytest.mark.parametrize("case", sorted(ROUTINGS))
def test_moe_matches_pytorch(
    checked_run: Callable[..., RunResult], case: str, tiles: tuple[int | None, int | None]
) -> None:
    routing = ROUTINGS[case]
    seeds = range(3) if routing is None else (0,)
    for seed in seeds:
        r = np.random.default_rng(seed).permuted(np.tile(np.arange(E), (7, 1)), axis=1)[:, :K]
        _run(checked_run, r if routing is None else routing, seed=seed, tiles=tiles)


def test_top1_all_tokens_to_one_expert(checked_run: Callable[..., RunResult]) -> None:
    res = _run(checked_run, np.full((5, 1), 2))
    assert [res.bindings[f"moe_n{e}"] for e in range(E)] == [0, 0, 5, 0]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_other_activations(checked_run: Callable[..., RunResult], activation: str) -> None:
    _run(checked_run, ROUTINGS["expert_3_unused"], activation=activation)


def test_expert_without_tokens_costs_no_weight_traffic(
    checked_run: Callable[..., RunResult],
) -> None:
    res = _run(checked_run, ROUTINGS["expert_3_unused"])
    assert res.bindings["moe_n3"] == 0
    for w in ("gate", "up", "down"):
        assert res.read_bytes[f"moe_e3_{w}_w"] == 0
        assert res.read_bytes[f"moe_e0_{w}_w"] == I * H * 4  # a used expert: its matrix once
    # x, ids (int64), weights, out per token; three I x H matrices per used expert
    assert res.offchip_bytes == 5 * (H * 4 + K * 8 + K * 4 + H * 4) + 3 * 3 * I * H * 4


def test_traffic_formula_is_closed_form() -> None:
    prog = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tile_h=8, tile_i=4)
    T = dyn("T")
    n = [dyn(f"moe_n{e}") for e in range(E)]
    expect = (2 * H * 4 + K * 12) * T + sum(
        sp.Piecewise((3 * I * H * 4, n[e] > 0), (0, True)) for e in range(E)
    )
    assert sp.simplify(metrics(prog).offchip_bytes - expect) == 0


def test_routing_is_data_one_program_two_routings(checked_run: Callable[..., RunResult]) -> None:
    """The same program: each run's expert tiles are as tall as the tokens routed there."""
    prog = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tile_h=8, tile_i=4)
    shapes = []
    for routing in (np.array([[0, 1]] * 4 + [[2, 3]]), np.array([[3, 2]] * 3 + [[1, 0]] * 2)):
        inp = moe_inputs(
            num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=5, routing=routing
        )
        res = checked_run(prog, tensors=inp)
        np.testing.assert_allclose(res.tensors["out"], moe_reference(**inp).numpy(), atol=1e-4)
        shapes.append(
            [[t.shape for t in res.values[f"moe_e{e}_xt"].elements()][:1] for e in range(E)]
        )
    assert shapes[0] == [[(4, H)], [(4, H)], [(1, H)], [(1, H)]]
    assert shapes[1] == [[(2, H)], [(2, H)], [(3, H)], [(3, H)]]


def test_two_blocks_in_one_graph(checked_run: Callable[..., RunResult]) -> None:
    """Two MoE layers chained in one graph (prefixes keep the node and symbol names apart)."""
    T = dyn("T")
    g = Graph("two_moe")
    x = g.tensor("x", (T, H))
    mid = g.tensor("mid", (T, H))
    out = g.tensor("out", (T, H))
    ts: dict[str, object] = {}
    for layer in ("a", "b"):
        ts[layer] = {
            "topk_idx": g.tensor(f"{layer}_idx", (T, K), "int64"),
            "topk_w": g.tensor(f"{layer}_w", (T, K)),
            "w_gate": g.tensor(f"{layer}_wg", (E, I, H)),
            "w_up": g.tensor(f"{layer}_wu", (E, I, H)),
            "w_down": g.tensor(f"{layer}_wd", (E, H, I)),
        }
    add_moe(g, x=x, out=mid, **ts["a"], num_experts=E, top_k=K, prefix="a")  # type: ignore[arg-type]
    add_moe(g, x=mid, out=out, **ts["b"], num_experts=E, top_k=K, prefix="b")  # type: ignore[arg-type]
    prog = g.build()
    ia = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=4, seed=1)
    ib = moe_inputs(num_experts=E, top_k=K, hidden=H, intermediate=I, tokens=4, seed=2)
    tensors = {"x": ia["x"]}
    for layer, inp in (("a", ia), ("b", ib)):
        tensors.update(
            {
                f"{layer}_idx": inp["topk_idx"],
                f"{layer}_w": inp["topk_w"],
                f"{layer}_wg": inp["w_gate"],
                f"{layer}_wu": inp["w_up"],
                f"{layer}_wd": inp["w_down"],
            }
        )
    # the second layer reads `mid` in the same run: node order makes the first write it first
    res = checked_run(prog, tensors=tensors)
    first = moe_reference(**ia)
    second = moe_reference(
        first, *(ib[k] for k in ("topk_idx", "topk_w", "w_gate", "w_up", "w_down"))
    )
    np.testing.assert_allclose(res.tensors["out"], second.numpy(), atol=1e-4)


def test_default_tiles() -> None:
    assert [default_tile(d) for d in (96, 256, 768, 2048, 4096, 14336, 300)] == [
        96,
        256,
        256,
        256,
        256,
        256,
        150,
    ]


def test_errors_name_what_to_change() -> None:
    with pytest.raises(StepTypeError, match="tile_h=5 must divide H=16"):
        moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, tile_h=5)
    with pytest.raises(StepTypeError, match="unknown activation 'tanh'"):
        moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I, activation="tanh")
    g = Graph()
    T = dyn("T")
    bad = {
        "x": g.tensor("x", (T, H)),
        "topk_idx": g.tensor("i", (T, K), "int64"),
        "topk_w": g.tensor("w", (T, K)),
        "w_gate": g.tensor("wg", (E, I, H)),
        "w_up": g.tensor("wu", (E, I, H)),
        "w_down": g.tensor("wd", (E, I, H)),
        "out": g.tensor("o", (T, H)),
    }
    with pytest.raises(StepTypeError, match=r"wd: \[4, 8, 16\] fp32 should have shape"):
        add_moe(g, **bad, num_experts=E, top_k=K)  # type: ignore[arg-type]
    prog = moe_graph(num_experts=E, top_k=K, hidden=H, intermediate=I)
    inp = moe_inputs(
        num_experts=E,
        top_k=K,
        hidden=H,
        intermediate=I,
        tokens=2,
        routing=np.array([[1, 1], [0, 2]]),
    )
    with pytest.raises(StepRuntimeError, match="selects an index twice"):
        run(prog, tensors=inp)
    inp["topk_idx"] = torch.tensor([[1, 4], [0, 2]])
    with pytest.raises(StepRuntimeError, match="expert id outside 0..3"):
        run(prog, tensors=inp)


def test_golden_printed_graph() -> None:
    prog = moe_graph(num_experts=2, top_k=1, hidden=8, intermediate=4, tile_h=4, tile_i=2)
    check_golden("moe_e2_k1_h8_i4_th4_ti2.txt", str(prog))
    whole = moe_graph(
        num_experts=2, top_k=2, hidden=8, intermediate=4, tokens=3, activation="gelu", prefix="blk"
    )
    check_golden("moe_e2_k2_h8_i4_whole_gelu.txt", str(whole))
