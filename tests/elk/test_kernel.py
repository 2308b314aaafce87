"""Kernel-by-kernel execution: functional equality with PyTorch on the ICCA presets, the cost
model against the simulator, the printable plan and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kernel_helpers import assert_kernel_run_equals, preload_alone_cycles

import torch2step
from elk.cost import ChipCosts, item_for
from elk.ops import decode_step_ops
from hwmodel.presets import load_chip
from lowering.elk_placement import place
from lowering.elk_programs import elk_programs
from models.registry import get_layer
from runtime import simulate
from torch2step.kernel.build import bind_timing
from torch2step.kernel.program import KernelProgram


@pytest.mark.parametrize("chip", ["ipu-hbm", "mesh"])
@pytest.mark.parametrize(
    "layer",
    [
        "llama-gqa",
        "qwen3-moe",
        "llama-decoder",
        pytest.param("qwen3-moe-decoder", marks=pytest.mark.slow),
    ],
)
def test_kernel_execution_equals_pytorch(layer: str, chip: str) -> None:
    """Whole decoder layers (norms, rotary, residuals, attention, MLP or MoE) included."""
    m, inp, ds, _ = get_layer(layer, tiny=True, batch=4)
    prog = torch2step.compile(m, inp, chip=chip, dynamic_shapes=ds)
    assert isinstance(prog, KernelProgram)  # ICCA presets default to kernel execution
    assert_kernel_run_equals(m, inp, prog)
    if layer == "qwen3-moe":
        # 4 tokens x top-2 of 8 experts: some experts get no token and still add nothing
        ids = torch.topk(torch.softmax(m.router(inp[0].reshape(4, -1)), -1), 2).indices
        assert len(set(ids.flatten().tolist())) < 8


def test_schedule_prints_every_operator() -> None:
    m, inp, ds, _ = get_layer("llama-gqa", tiny=True, batch=2)
    prog = torch2step.compile(m, inp, chip="ipu-hbm", dynamic_shapes=ds, design="elk_dyn")
    text = str(prog.schedule)
    for op in prog.schedule.ops:
        assert op.name in text
    assert "breakdown:" in text and "pre#" in text


@pytest.mark.parametrize("name", ["qkv_proj", "attention", "rotary"])
def test_cost_model_matches_simulator_per_operator_kind(name: str) -> None:
    """Preload + execute of one full-size operator (matmul, attention, vector) with its fastest
    plan on ipu-hbm: simulated within 10% of the predicted bounds.  The execution's own traffic
    passes its preload's pieces at the cores' ports and the HBM (runtime.network: preload reads
    are background traffic), so it runs while the preload arrives, its kernel needing the last
    piece ``slack`` cycles in (the overlapped bound, which the schedule uses); a product whose
    weight pieces arrive no faster than it multiplies them ends nearer the sequential bound
    (qkv_proj: 24.1k cycles simulated, 19.1k overlapped, 38.0k sequential)."""
    chip = load_chip("ipu-hbm")
    costs = ChipCosts.from_chip(chip)
    op = next(o for o in decode_step_ops("llama3-8b", 32, 2048, 1) if o.name.endswith(name))
    it = item_for(costs, op)
    e = it.fastest
    plan = it.execs[e].ref
    ops, tensors = bind_timing([op], [plan])
    total = simulate(elk_programs(chip, ops, [plan], [0], [1], tensors), chip).cycles
    sequential = it.load_time(e) + plan.time
    overlapped = max(it.load_time(e), it.slack(e)) + plan.time - it.slack(e)
    assert 0.9 * overlapped <= total <= 1.1 * sequential
    if op.kind != "vector":
        pre = preload_alone_cycles(chip, ops, plan, tensors)
        assert abs(it.load_time(e) / pre - 1) < 0.20  # preload alone


def test_cli_report_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    from torch2step.cli import main

    assert main(["report", "--layer", "llama-gqa", "--batch", "8", "--chip", "ipu-hbm"]) == 0
    out = capsys.readouterr().out
    assert "ELK schedule" in out and "breakdown" in out and "interconnect" in out
    assert "FLOP utilisation" in out and "of Ideal" in out and "per token" in out


def test_cli_report_kernel_takes_the_design_and_the_plans_search(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--design`` and ``--plan`` reach the ELK plan, which prints the search it used; the
    spatial report refuses them, and a bad ``--plan`` is named."""
    from elk.plan import plan_model
    from torch2step.cli import main
    from torch2step.kernel.layers import registered_layer_ops

    argv = ["report", "--layer", "llama-gqa", "--batch", "8", "--chip", "ipu-hbm", "--json"]
    assert main([*argv, "--design", "static", "--plan", "window=4", "--plan", "orders=2"]) == 0
    got = json.loads(capsys.readouterr().out)
    ops = registered_layer_ops("llama-gqa", 8, 2048, "bf16", None)
    want = plan_model(ops, load_chip("ipu-hbm"), "static", window=4, max_orders=2)
    assert got["design"] == "static" and got["predicted_cycles"] == round(want.cycles)
    assert got["plan_search"] == {"window": 4, "max_orders": 2}
    assert "(search plan_window=4, plan_orders=2)" in str(want).splitlines()[0]
    assert "(search" not in str(plan_model(ops, load_chip("ipu-hbm"), "static")).splitlines()[0]

    def error(argv: list[str]) -> str:  # one line on stderr, exit status 2
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    spatial = ["report", "--layer", "llama-gqa", "--chip", "step-sda"]
    err = error([*spatial, "--design", "basic", "--plan", "beam=2"])
    assert "--design, --plan: options of the kernel-by-kernel execution" in err
    for bad, why in (("beam", "KEY=VALUE"), ("depth=2", "KEY one of"), ("beam=0", "positive"),
                     ("window_data=2", "0 or 1"), ("orders=x", "integer")):  # fmt: skip
        assert why in error([*argv, "--plan", bad])


def test_compile_takes_the_plans_search_and_a_shorter_step_keeps_it() -> None:
    from elk.plan import plan_model
    from torch2step.errors import LoweringError, Torch2StepError
    from torch2step.frontend.hf_config import compile_config

    m, inp, ds, _ = get_layer("llama-gqa", tiny=True, batch=2)
    prog = torch2step.compile(m, inp, chip="ipu-hbm", plan_beam=1, plan_window_data=True)
    want = plan_model(prog.graph.ops, load_chip("ipu-hbm"), dtype=prog.graph.dtype, beam=1,
                      window_data=True)  # fmt: skip
    assert prog.schedule.plans == want.plans and prog.schedule.cycles == want.cycles
    assert dict(prog.schedule.search) == {"beam": 1, "window_data": True}
    with pytest.raises(Torch2StepError, match="plan_window=0: give a positive integer"):
        torch2step.compile(m, inp, chip="ipu-hbm", plan_window=0)
    with pytest.raises(LoweringError, match="plan_orders set the search of an ELK plan"):
        torch2step.compile(m, inp, chip="step-sda", plan_orders=2)
    cfg = Path(__file__).resolve().parents[2] / "models" / "hf_configs" / "llama-3-8b.json"
    stack = compile_config(cfg, batch=4, past=16, chip="ipu-hbm", layers=6, plan_orders=1)
    assert stack.search == {"max_orders": 1} and stack.shorter(5).search == {"max_orders": 1}
    assert dict(stack.shorter(5).schedule.search) == {"max_orders": 1}


def test_execution_choice() -> None:
    from torch2step.errors import LoweringError
    from torch2step.program import Program

    m, inp, ds, _ = get_layer("qwen3-moe", tiny=True, batch=2)
    assert isinstance(torch2step.compile(m, inp, chip="ipu-hbm", execution="spatial"), Program)
    assert isinstance(torch2step.compile(m, inp, chip="step-sda"), Program)
    with pytest.raises(LoweringError, match="execution"):
        torch2step.compile(m, inp, chip="ipu-hbm", execution="dataflow")


def test_kernel_execution_refuses_the_options_of_a_step_program() -> None:
    """Tiling and STeP §5 strategies shape a STeP program; kernel execution plans with ELK
    and would ignore them, so they are refused (all named), on a layer and on a stack."""
    from torch2step.errors import LoweringError
    from torch2step.frontend.hf_config import compile_config
    from torch2step.kernel.program import KernelProgram

    m, inp, ds, _ = get_layer("qwen3-moe", tiny=True, batch=2)
    with pytest.raises(LoweringError, match=r"moe_lanes, tile_rows shape a STeP program"):
        torch2step.compile(m, inp, chip="ipu-hbm", tile_rows=64, moe_lanes=2)
    with pytest.raises(LoweringError, match="strategy.*execution='spatial'"):
        torch2step.compile(m, inp, chip="mesh", strategy="auto")
    assert isinstance(torch2step.compile(m, inp, chip="ipu-hbm", strategy="default"), KernelProgram)
    # the same options place the STeP program on the ICCA chip when asked for
    spatial = torch2step.compile(m, inp, chip="ipu-hbm", execution="spatial", moe_lanes=2)
    assert spatial.execution == "spatial"
    cfg = Path(__file__).resolve().parents[2] / "models" / "hf_configs" / "llama-3-8b.json"
    with pytest.raises(LoweringError, match="tile_kv shape a STeP program"):
        compile_config(cfg, batch=4, past=16, chip="ipu-hbm", layers=2, tile_kv=64)
    compile_config(cfg, batch=4, past=16, chip="ipu-hbm", layers=2, strategy="default")


def test_decode_step_plan_orders_designs() -> None:
    """A two-layer Llama-3-8B decode step on ipu-hbm: every design fits, Ideal is the fastest,
    ELK-Full is no slower than ELK-Dyn or Basic."""
    from elk.designs import DESIGNS
    from elk.plan import plan_model

    ops = decode_step_ops("llama3-8b", 32, 2048, 2)
    chip = load_chip("ipu-hbm")
    got = {d: plan_model(ops, chip, d, window=8, beam=2, max_orders=4).cycles for d in DESIGNS}
    assert got["ideal"] <= min(got.values()) + 1e-6
    assert got["elk_full"] <= got["elk_dyn"] + 1e-6
    assert got["elk_full"] <= got["basic"] + 1e-6


@pytest.mark.parametrize("chip", ["ipu-hbm", "mesh"])
def test_placed_plans_fit_every_core(chip: str) -> None:
    """The planner places its plan and checks every core's peak SRAM (ELK plans are made for
    the aggregate memory; tiles are whole per core)."""
    from elk.plan import plan_model

    hw = load_chip(chip)
    for model in ("llama3-8b", "qwen3-30b-a3b"):
        ops = decode_step_ops(model, 32, 2048, 2)
        for design in ("basic", "static", "elk_full"):
            s = plan_model(ops, hw, design, window=8, beam=2, max_orders=4)
            assert s.core_peak is not None and 0 < s.core_peak <= hw.core.sram_bytes


def test_activations_stay_on_chip_between_operators() -> None:
    """ELK §4.5: only the layer's inputs, preloads and results touch HBM; every tensor an
    operator produces and a later one reads travels core to core (no HBM load of it)."""
    from lowering.isa import Compute, Load, Store

    m, inp, ds, _ = get_layer("llama-gqa", tiny=True, batch=2)
    prog = torch2step.compile(m, inp, chip="ipu-hbm", dynamic_shapes=ds)
    produced = {
        t
        for op in prog.graph.ops
        for role, t in op.tensors
        if role in ("y", "o") or role.startswith("out")
    }
    results = set(prog.graph.stored())  # an appended KV cache stores its new row only
    body = [ins for p in prog.programs.programs for ins in p.body]
    loaded = {ins.tensor for ins in body if isinstance(ins, Load)}
    stored = {ins.tensor for ins in body if isinstance(ins, Store)}
    assert not loaded & produced
    assert stored == results
    assert any(isinstance(ins, Compute) and ins.kernel == "elk_place" for ins in body)


def test_held_output_tiles_count_in_core_peaks() -> None:
    """ELK §4.5: an operator's output tiles stay on its cores until the next operator has
    gathered them, so the per-core SRAM check counts them in the next section."""
    from lowering.elk_placement import _place, held_output

    chip = load_chip("ipu-hbm")
    costs = ChipCosts.from_chip(chip)
    ops = decode_step_ops("llama3-8b", 32, 2048, 1)[1:3]  # qkv_proj, rotary
    plans = [(it := item_for(costs, op)).execs[it.fastest].ref for op in ops]
    placed, load = _place(chip, ops, plans, (0, 1), (1, 2))
    held = held_output(placed[0])
    m, _, n = ops[0].dims
    assert sum(b for _, b in held) == m * n * ops[0].elem
    assert {c for c, _ in held} <= set(placed[0].cores)
    for core, nbytes in held:
        on_rotary = plans[1].core_space if core in placed[1].cores else 0
        assert load[core, 1] == nbytes + on_rotary


def test_kernel_program_is_planned_in_the_served_dtype() -> None:
    """A bf16 layer's operators and weights are bf16 (2-byte elements), its fp32 twin's fp32."""
    for dt in (torch.float32, torch.bfloat16):
        m, inp, _, _ = get_layer("llama-gqa", tiny=True, batch=2, dtype=dt)
        prog = torch2step.compile(m, inp, chip="ipu-hbm")
        assert isinstance(prog, KernelProgram)
        name = "bf16" if dt == torch.bfloat16 else "fp32"
        assert prog.graph.dtype == name and {op.dtype for op in prog.graph.ops} == {name}
        assert {prog.graph.tensors[w][1] for w in prog.graph.weights.values()} == {name}


def test_mesh_attention_groups_fold_side_by_side() -> None:
    """A decode attention with more (batch, KV head) groups than the mesh has rows puts
    several groups side by side in one mesh row (each group's KV slices contiguous along its
    row, ELK §5), so Llama-3-8B's batch-64 KV cache (512 MiB) has a plan on the mesh preset."""
    from elk.cost import footprint, plans_for

    chip = load_chip("mesh")
    costs = ChipCosts.from_chip(chip)
    op = next(o for o in decode_step_ops("llama3-8b", 64, 2048, 1) if o.kind == "attention")
    plans = plans_for(costs, op)
    assert plans and all(p.core_space <= chip.core.sram_bytes for p in plans)
    assert costs.mesh is not None
    folded = [p for p in plans if p.tiles[0] * p.tiles[1] > costs.mesh[0]]
    assert folded
    plan = folded[-1]
    rows, cols = footprint(plan, costs.mesh)
    assert rows <= costs.mesh[0] and cols <= costs.mesh[1]
    ops, _ = bind_timing([op], [plan])
    pl = place(chip, ops, [plan])[0]
    assert len(set(pl.cores)) == plan.cores
    for r in range(pl.rows):
        coords = [chip.mesh_coords(pl.core(r, c)) for c in range(pl.cols)]
        assert len({y for y, _ in coords}) == 1  # one mesh row per group
        assert [x for _, x in coords] == list(range(coords[0][1], coords[0][1] + pl.cols))
        assert coords[0][0] < chip.noc.rows - 1  # the controller's row stays free


def test_plans_that_preload_sooner_are_offered_to_elk_only() -> None:
    """ELK §4.2: a preload takes the HBM roofline or the interconnect delivery, whichever is
    longer, so on four IPU-like chips with 16 TB/s of HBM (ELK §6.1) an attention spread over
    more cores than its fastest plan's loads its KV cache sooner (the fastest plan's per-core
    delivery is port-bound).  Such plans follow the space/time Pareto curve in
    ``Item.execs``; the fixed-rule designs (Basic, Static) keep to the curve, ELK's search
    may take them."""
    import dataclasses

    from elk.cost import plans_for
    from elk.plan import plan_model

    base = load_chip("ipu-hbm")
    chip = dataclasses.replace(
        base,
        num_cores=4 * base.num_cores,
        hbm=dataclasses.replace(base.hbm, channels=4 * base.hbm.channels),
    )
    costs = ChipCosts.from_chip(chip)
    ops = decode_step_ops("llama3-8b", 32, 2048, 1)
    att = next(o for o in ops if o.kind == "attention")
    it = item_for(costs, att)
    front = plans_for(costs, att)
    assert it.pareto == len(front) < len(it.execs)
    assert it.execs[it.fastest].ref == min(front, key=lambda p: p.time)
    for e in range(it.pareto, len(it.execs)):
        p = it.execs[e].ref
        cover = [k for k, f in enumerate(front) if f.space <= p.space and f.time <= p.time]
        assert all(it.load_time(e) < it.load_time(k) for k in cover)
    for design in ("basic", "static"):
        s = plan_model(ops, costs, design, window=8, beam=2)
        assert all(st.exec_plan < s.items[st.op].pareto for st in s.timeline.steps)


def test_dense_mlp_projections_are_separate_operators_and_plan_on_the_mesh() -> None:
    """Llama's gate_proj and up_proj are two weights (HF LlamaMLP), so two operators; at batch
    64 each fits the mesh's row-by-column grids (a fused 235 MB gate+up did not: its tile and
    partial sums overflow a core on any divisor grid of 31 x 46 worker cores)."""
    from elk.plan import plan_model

    ops = decode_step_ops("llama3-8b", 64, 2048, 1)
    mm = {o.name.split(".")[1]: o.dims for o in ops if o.kind == "matmul"}
    assert mm["gate"] == mm["up"] == (64, 4096, 14336) and mm["down"] == (64, 14336, 4096)
    s = plan_model(ops, load_chip("mesh"), "ideal")
    assert s.cycles > 0 and len(s.plans) == len(ops)


def test_the_schedule_table_shows_each_operators_interconnect_stall() -> None:
    from elk.plan import format_schedule, plan_model
    from torch2step.kernel.layers import registered_layer_ops

    ops = registered_layer_ops("llama-gqa", 8, 2048, "bf16", None)
    s = plan_model(ops, load_chip("ipu-hbm"), "elk_full")
    lines = format_schedule(s).splitlines()
    assert "exec us stall us start us" in " ".join(lines[1].split())
    clk = s.costs.clock_ghz * 1e3
    stalls = [float(ln.split()[-2]) for ln in lines[2 : 2 + len(s.ops)]]
    assert stalls == [round(st.stall / clk, 2) for st in s.timeline.steps]
    # the stalls are the breakdown's interconnect share (at most the overlapped time)
    assert s.breakdown()["interconnect"] <= sum(st.stall for st in s.timeline.steps) + 1e-6


def test_kernel_json_carries_the_spatial_reports_names(capsys: pytest.CaptureFixture[str]) -> None:
    from torch2step.cli import main

    argv = ["report", "--layer", "llama-gqa", "--batch", "8", "--chip", "ipu-hbm", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["execution"] == "kernel" and got["latency_cycles"] == got["cycles"]
    assert got["latency_s"] * 1e6 == pytest.approx(got["latency_us"])
    assert (got["layer"], got["batch"], got["dtype"], got["kv_len"]) == (
        "llama-gqa",
        8,
        "bf16",
        2048,
    )
