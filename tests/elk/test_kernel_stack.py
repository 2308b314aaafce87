"""A decode step of N identical layers run kernel by kernel (ELK §4.4): one plan over N x the
body's operators, the same preload order in every layer, functional equality with PyTorch,
and the config-only (shapes, no weights) report through the API and the command line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch2step  # noqa: E402
from models.decoder import tiny_config_dict  # noqa: E402
from torch2step.kernel.stack import KernelStackProgram  # noqa: E402
from torch2step.layers import evaluate  # noqa: E402


@pytest.fixture(scope="module")
def stack3(tiny_llama_stack):
    g, x, k, v = tiny_llama_stack(3)
    ks, vs = torch.stack([k, k + 1, k - 1]), torch.stack([v, -v, v * 2])
    prog = torch2step.compile(g, (x, ks, vs), chip="ipu-hbm")
    return g, prog, (x, ks, vs)


def _layer_order(prog: KernelStackProgram, li: int) -> list[int]:
    n = len(prog.body_ops.ops)
    return [o - li * n for o in prog.schedule.order if li * n <= o < (li + 1) * n]


def test_one_plan_holds_every_layers_operators(stack3) -> None:
    _, prog, _ = stack3
    assert isinstance(prog, KernelStackProgram)
    n = len(prog.body_ops.ops)
    ops = prog.schedule.ops
    assert len(ops) == 3 * n
    assert [o.layer for o in ops] == [li for li in range(3) for _ in range(n)]
    assert [o.slot for o in ops[n : 2 * n]] == [o.slot for o in ops[:n]]
    # layer 1 reads layer 0's output, not the stack's input
    first = ops[n].tensors[0][1]
    assert first.startswith("L0.") and first in {t for _, t in ops[n - 1].tensors}
    assert sorted(prog.schedule.order) == list(range(3 * n))


def test_identical_layers_share_one_preload_order(stack3) -> None:
    _, prog, _ = stack3
    orders = [_layer_order(prog, li) for li in range(3)]
    assert orders[0] == orders[1] == orders[2]


def test_stack_runs_kernel_by_kernel_equal_to_pytorch(stack3) -> None:
    g, prog, ins = stack3
    for got, want in zip(prog.run(*ins), evaluate(g, *ins)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_report_simulates_the_first_layers_and_predicts_the_rest(stack3) -> None:
    _, prog, _ = stack3
    one, every = prog.report(sim_layers=1), prog.report(sim_layers=3)
    assert one.sim_layers == 1 and every.sim_layers == 3
    assert 0 < one.sim.cycles < every.sim.cycles == every.cycles
    assert one.cycles == round(one.sim.cycles + prog.schedule.cycles - one.sim_predicted)
    d = one.to_dict()
    assert (
        d["layers"] == 3 and d["simulated_layers"] == 1 and d["operators"] == len(prog.schedule.ops)
    )
    assert set(d["breakdown"]) == {"preload", "execute", "overlapped", "interconnect", "idle"}
    # the step's utilisations are over its reported cycles, the plan's over its predicted ones
    scale = prog.schedule.cycles / one.cycles
    assert d["hbm_util"] == pytest.approx(d["hbm_util_plan"] * scale, abs=2e-4)
    assert d["noc_util"] == pytest.approx(d["noc_util_plan"] * scale, abs=2e-4)
    assert "simulated" in str(one) and "the plan's prediction" in str(one)
    with pytest.raises(torch2step.Torch2StepError, match="simulate 1..3 layers"):
        prog.report(sim_layers=4)


def test_report_simulates_every_layer_of_a_short_step_by_default(stack3) -> None:
    _, prog, _ = stack3
    rep, every = prog.report(), prog.report(sim_layers=3)
    assert rep.sim_layers == 3 and rep.cycles == every.cycles == rep.sim.cycles


def test_config_stack_reports_without_weights_and_refuses_to_run(tmp_path, capsys) -> None:
    from torch2step.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("llama", num_hidden_layers=6)))
    prog = torch2step.compile_config(path, batch=2, past=8, layers=2, chip="ipu-hbm")
    assert isinstance(prog, KernelStackProgram) and prog.graph.shapes_only
    assert len(prog.schedule.ops) == 2 * len(prog.body_ops.ops)
    # timing from shapes: row-partitioned vector operators, no views, no whole-cache copy
    assert all(o.node is None for o in prog.schedule.ops)
    assert not any("reshape" in o.name or "arange" in o.name for o in prog.schedule.ops)
    assert any(o.name.endswith(".append") for o in prog.schedule.ops)
    with pytest.raises(torch2step.Torch2StepError, match="needs weights"):
        prog.run()
    argv = ["report", "--hf-config", str(path), "--layers", "2", "--batch", "2", "--chip"]
    assert main([*argv, "ipu-hbm", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["layers"] == 2 and rep["design"] == "elk_full" and rep["cycles"] > 0


def test_config_moe_times_the_experts_its_tokens_select(tmp_path) -> None:
    # a MoE decoder from its config (no weights, no routing): the experts the tokens select in
    # expectation under uniform routing, as grouped operators; the others are never loaded
    from elk.ops import expected_active

    cfg = tiny_config_dict("qwen3_moe", num_experts=16, num_experts_per_tok=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    prog = torch2step.compile_config(path, batch=2, past=8, chip="ipu-hbm")
    names = [o.name for o in prog.schedule.ops]
    assert not any(".e0." in n or n.endswith(".route") for n in names)  # no dense experts
    ups = [o for o in prog.schedule.ops if o.name.endswith("_gate_up")]
    active = expected_active(16, 2, 2)
    assert active == 4 and sum(o.dims[2] for o in ups) == 2 * 32 * active
    assert all(o.dims[0] == 1 for o in ups)  # 2 tokens x top-2 over 4 experts: a row each
    assert any(n.endswith(".experts_sum") for n in names)
    rep = prog.report(tokens=2)
    assert rep.cycles > 0 and "4 of 16 experts active" in str(rep)
    assert rep.to_dict()["notes"] == list(rep.notes)
    stack = torch2step.compile_config(path, batch=2, past=8, layers=2, chip="ipu-hbm")
    assert [n.startswith("each layer's") for n in stack.graph.notes] == [True]


def test_config_moe_plans_the_experts_a_routing_selects(tmp_path) -> None:
    # with routing= the plan loads the experts the ids name (here 3, against 4 expected under
    # uniform routing), in one layer and in every layer of a stack; a spatial program takes
    # routing at report time instead
    cfg = tiny_config_dict("qwen3_moe", num_experts=16, num_experts_per_tok=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    ids = np.array([[0, 5], [5, 9]])
    prog = torch2step.compile_config(path, batch=2, past=8, chip="ipu-hbm", routing=ids)
    ups = [o for o in prog.schedule.ops if o.name.endswith("_gate_up")]
    assert sum(o.dims[2] for o in ups) == 2 * 32 * 3
    # expert 5 gets two rows, 0 and 9 one each: the group is timed at its busiest expert's
    # rows and counts the FLOPs of the four rows routed (2 x rows x hidden x 2 x inter)
    (up,) = ups
    assert up.dims[0] == 2 and up.flops == 2 * 4 * up.dims[1] * 2 * 32
    # the experts' weights are preloaded once the routing operator has chosen them
    names = [o.name for o in prog.schedule.ops]
    assert up.routed_by in names and names.index(up.routed_by) < names.index(up.name)
    rep = prog.report(tokens=2)
    assert "3 of 16 experts active, as the routing's 2 tokens select" in str(rep)
    assert f"preloaded once {up.routed_by} has chosen them" in str(rep)
    stack = torch2step.compile_config(
        path, batch=2, past=8, layers=2, chip="ipu-hbm", routing=ids
    )
    ups = [o for o in stack.schedule.ops if o.name.endswith("_gate_up")]
    assert sum(o.dims[2] for o in ups) == 2 * (2 * 32 * 3)  # two layers of three experts
    assert [o.routed_by.split(".")[0] for o in ups] == ["L0", "L1"]
    with pytest.raises(torch2step.LoweringError, match=r"expected \[2, 2\] integer expert ids"):
        torch2step.compile_config(path, batch=2, past=8, chip="ipu-hbm", routing=ids[:1])
    with pytest.raises(torch2step.LoweringError, match="report\\(..., routing=ids\\)"):
        torch2step.compile_config(path, batch=2, past=8, chip="step-sda", routing=ids)
