"""The text report says what each figure counts: two compute shares, the cores the run holds,
the operators the table leaves out, the trace's size in ``report.md``, the fp32 timing note of a
layer split into configurations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hwmodel.presets import load_chip, with_mesh_shape
from torch2step.cli import main
from torch2step.named import LayerRun, report_layer
from torch2step.report import OPERATOR_ROWS, Report
from torch2step.rundir import write_run_dir
from torch2step.spatial.sram import sram_spans

_FP32_NOTE = "fp32 tiles are timed at the cores' 16-bit rate"


@pytest.fixture(scope="module")
def moe() -> LayerRun:
    """The tiny MoE layer at batch 8 on step-sda (fits whole, no unit spills)."""
    return report_layer("qwen3-moe", 8, tiny=True)


def _report(units: list[dict[str, Any]], sram: int = 1000, cores: int = 32) -> Report:
    """A report with only ``units`` and a chip of ``cores`` cores of ``sram`` bytes."""
    return Report(
        layer="L",
        chip="c",
        latency_cycles=100,
        latency_s=1e-7,
        hbm_bytes=0,
        hbm_bytes_symbolic=0,
        hbm_bytes_formula="0",
        peak_onchip_bytes=0,
        onchip_formula="0",
        flops=0,
        roofline_cycles=0,
        roofline_fraction=0.0,
        units=units,
        chip_spec={"num_cores": cores, "clock_ghz": 1.0, "core": {"sram_bytes": sram}},
    )


def _unit(origin: str, cores: tuple[int, ...], busy: int = 1, held: int = 0, **kw: Any) -> dict:
    """A unit record of operator ``origin`` on ``cores``, ``held`` bytes in its buffers."""
    counts = dict.fromkeys(("stall_recv", "stall_send", "stall_mem", "idle", "finish"), 0)
    return {
        "name": f"{origin}_{cores[0]}",
        "ops": [f"{origin}_{cores[0]}"],
        "kinds": ["Map"],
        "origin": origin,
        "cores": cores,
        "busy": busy,
        **counts,
        "flops": 0,
        "sram_bytes": held,
        "fifo_bytes": 0,
        "received": 0,
        "sent": 0,
        **kw,
    }


def test_the_two_compute_shares_say_what_they_divide_by(moe: LayerRun) -> None:
    rep = moe.report
    per_core = rep.peak_flops_per_cycle / rep.cores_available
    # headline: the whole chip's peak; utilisation: the peak of the cores the units are on
    whole = rep.flops / rep.latency_cycles / (rep.cores_available * per_core)
    placed = rep.flops / rep.latency_cycles / (rep.cores_placed * per_core)
    assert rep.compute_fraction == pytest.approx(whole)
    assert rep.utilisation["compute"] == pytest.approx(placed)
    text = str(rep)
    assert (
        f"{rep.compute_fraction:.1%} of the whole chip's peak {rep.peak_flops_per_cycle:,} "
        f"FLOPs/cycle (all {rep.cores_available:,} cores)"
    ) in text
    util = text.split("utilisation (")[1]
    line = next(x for x in util.splitlines() if x.startswith("    compute "))
    assert f"{rep.utilisation['compute']:6.1%}" in line
    assert f"FLOPs over the peak of the {rep.cores_placed:,} cores the units are placed on" in line
    assert f"whole chip {rep.compute_fraction:.1%}" in line


def test_the_operator_table_says_how_many_rows_it_leaves_out(tmp_path: Path) -> None:
    many = _report([_unit(f"op{i}", (i,), busy=100 - i) for i in range(OPERATOR_ROWS + 4)])
    text = str(many)
    assert "    op15 " in text and "    op16 " not in text
    assert "... 4 more operators (see --json or --out)" in text
    md = (write_run_dir(tmp_path / "run", many) / "report.md").read_text()
    assert "... 4 more operators (see operators.csv and summary.json)" in md
    few = _report([_unit(f"op{i}", (i,)) for i in range(OPERATOR_ROWS)])
    assert "more operators" not in str(few)


def test_report_md_states_the_trace_size(tmp_path: Path) -> None:
    out = tmp_path / "qwen"
    argv = ["report", "--layer", "qwen3-moe", "--tiny", "--batch", "8", "--out", str(out), "-q"]
    assert main(argv) == 0
    size = (out / "trace.json").stat().st_size
    assert f"- `trace.json` ({size:,} bytes): the timeline" in (out / "report.md").read_text()


def test_split_layer_keeps_the_fp32_note_once() -> None:
    chip = with_mesh_shape(load_chip("step-sda"), 4, 8)  # too few cores: split
    rep = report_layer("llama-gqa", 4, chip=chip, tiny=True, dtype="fp32").report
    assert rep.dynamic["configurations"] > 1
    assert sum(n.startswith(_FP32_NOTE) for n in rep.notes) == 1
    assert str(rep).count(_FP32_NOTE) == 1
    assert rep.to_dict()["notes"] == rep.notes
    bf16 = report_layer("llama-gqa", 4, chip=chip, tiny=True).report
    assert bf16.dynamic["configurations"] > 1
    assert not any(n.startswith(_FP32_NOTE) for n in bf16.notes)
    whole = report_layer("llama-gqa", 4, tiny=True, dtype="fp32").report
    assert "configurations" not in whole.dynamic
    assert sum(n.startswith(_FP32_NOTE) for n in whole.notes) == 1


def test_cores_used_count_the_cores_holding_spilled_fifos() -> None:
    # a core SRAM so small that a unit's deepened FIFOs outgrow the cores it was placed on
    run = report_layer("qwen3-moe", 64, tiny=True, sets=["core.sram_bytes=2200"])
    rep, sim = run.report, run.program._last
    spill = sum(s.need - s.placed for s in sram_spans(sim.units, run.program.chip))
    assert spill > 0
    assert rep.cores_placed == sim.cores_used
    assert rep.cores_for_fifos == spill
    assert rep.cores_used == sim.cores_used + spill
    assert rep.sram_capacity_bytes == rep.cores_used * 2200
    assert (
        f"{rep.cores_used:,} of {rep.cores_available:,} cores used ({rep.cores_placed:,} placed, "
        f"{spill:,} more holding units' FIFOs)"
    ) in str(rep)
    assert f"of {rep.sram_capacity_bytes:,} in the cores used" in str(rep)
    derived = rep.derived()
    assert (derived["cores_used"], derived["cores_placed"], derived["cores_for_fifos"]) == (
        rep.cores_used,
        rep.cores_placed,
        spill,
    )


def test_cores_used_without_spill_is_the_placed_cores(moe: LayerRun) -> None:
    rep = moe.report
    assert rep.cores_for_fifos == 0
    assert rep.cores_used == rep.cores_placed == len({c for u in rep.units for c in u["cores"]})
    assert f"{rep.cores_used:,} of {rep.cores_available:,} cores used, HBM" in str(rep)


def test_split_cores_used_is_the_largest_configuration() -> None:
    rep = _report(
        [
            *(_unit("a", (i,), configuration=1) for i in range(10)),
            *(_unit("b", (i,), configuration=2) for i in range(7)),
            _unit("c", (7,), held=3500, configuration=2),  # 4 cores' SRAM, placed on 1
        ]
    )
    assert (rep.cores_used, rep.cores_placed, rep.cores_for_fifos) == (11, 8, 3)
    assert "11 of 32 cores used (8 placed, 3 more holding units' FIFOs) in the largest" in str(rep)


def test_padded_linear_rows_are_said_and_static_shapes_do_not_pad() -> None:
    import torch

    import torch2step

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(256, 512, bias=False),
        torch.nn.SiLU(),
        torch.nn.Linear(512, 256, bias=False),
    )
    x = torch.randn(8, 256)
    dyn = torch2step.compile(m, (x,)).report(x)
    note = next(n for n in dyn.notes if n.startswith("Linear rows are a dynamic size"))
    assert "8 rows take 64, 88% of them padding" in note and "tile_rows=8" in note
    static = torch2step.compile(m, (x,), dynamic_shapes={"input": {}}).report(x)
    assert not any(n.startswith("Linear rows") for n in static.notes)
    assert static.flops < dyn.flops and static.latency_cycles < dyn.latency_cycles
    full = torch2step.compile(m, (x,)).report(torch.randn(64, 256))  # whole blocks: no note
    assert not any(n.startswith("Linear rows") for n in full.notes)
    # the FLOPs line names padding only where the note gives it
    pad, whole = (next(ln for ln in str(r).splitlines() if "FLOPs  " in ln) for r in (dyn, full))
    assert "padding rows of the note below included" in pad
    assert "padding" not in whole and "as the tiles compute them" in whole


def test_save_with_a_program_without_a_trace_writes_nothing(tmp_path) -> None:  # noqa: ANN001
    import pytest

    import torch2step
    from models import get_layer
    from torch2step.errors import Torch2StepError

    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(spec.module, spec.example_inputs)
    rep = prog.report(*spec.example_inputs)
    assert not prog.has_trace
    with pytest.raises(Torch2StepError, match="recorded no trace"):
        rep.save(tmp_path / "run", trace=prog)
    assert not (tmp_path / "run").exists()
    traced = prog.report(*spec.example_inputs, trace=True)
    assert prog.has_trace
    out = traced.save(tmp_path / "run", trace=prog)
    assert (out / "trace.json").stat().st_size > 0
