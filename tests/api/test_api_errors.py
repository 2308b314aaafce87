"""Clear errors from the public API: wrong inputs, unknown options, missing files."""

from __future__ import annotations

import re

import pytest
import torch

import models
import torch2step
from hwmodel.errors import ChipConfigError
from torch2step.errors import FrontendError, LoweringError, Torch2StepError


@pytest.fixture(scope="module")
def moe() -> torch2step.Program:
    spec = models.get_layer("mixtral-moe", tiny=True, batch=4)
    return torch2step.compile(spec.module, spec.example_inputs)


def test_exports_public_names() -> None:
    for name in ("compile", "import_onnx", "Program", "Report"):
        assert name in torch2step.__all__ and hasattr(torch2step, name)


def test_wrong_feature_size(moe: torch2step.Program) -> None:
    with pytest.raises(FrontendError, match="axis 2.*compiled for 64"):
        moe.run(torch.randn(3, 1, 65))


def test_wrong_rank_dtype_and_count(moe: torch2step.Program) -> None:
    with pytest.raises(FrontendError, match="expected 3 dims"):
        moe.run(torch.randn(3, 64))
    with pytest.raises(FrontendError, match="dtype"):
        moe.run(torch.ones(3, 1, 64, dtype=torch.int64))
    with pytest.raises(FrontendError, match="expected 1 inputs"):
        moe.run(torch.randn(3, 1, 64), torch.randn(3, 1, 64))


def test_unknown_option_and_chip() -> None:
    spec = models.get_layer("mixtral-moe", tiny=True, batch=2)
    with pytest.raises(LoweringError, match="valid options: tile_rows"):
        torch2step.compile(spec.module, spec.example_inputs, tile_size=3)
    with pytest.raises(ChipConfigError, match="step-sda"):
        torch2step.compile(spec.module, spec.example_inputs, chip="no-such-chip")
    with pytest.raises(ChipConfigError, match="chip=3: give a preset name"):
        torch2step.compile(spec.module, spec.example_inputs, chip=3)


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"tile_rows": "32"}, "option tile_rows='32': must be an integer"),
        ({"tile_rows": 3.5}, "option tile_rows=3.5: must be an integer"),
        ({"moe_lanes": 2.0}, "option moe_lanes=2.0: must be an integer or None"),
        ({"stream_rows": 1}, "option stream_rows=1: must be True or False"),
    ],
)
def test_an_option_of_the_wrong_kind_is_named(option: dict, says: str) -> None:
    spec = models.get_layer("mixtral-moe", tiny=True, batch=2)
    with pytest.raises(LoweringError, match=re.escape(says)):
        torch2step.compile(spec.module, spec.example_inputs, **option)


def test_missing_onnx_file() -> None:
    with pytest.raises(FrontendError, match="missing.onnx"):
        torch2step.compile("/nonexistent/missing.onnx")


def test_same_inputs_same_report(moe: torch2step.Program) -> None:
    x = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(3))
    a, b = moe.report(x), moe.report(x)
    assert a.to_dict() == {**b.to_dict(), "simulation_s": a.simulation_s}


def test_meta_weights_cannot_run() -> None:
    spec = models.get_layer("mixtral-moe", tiny=True, batch=2, device="meta")
    prog = torch2step.compile(spec.module, spec.example_inputs)
    with pytest.raises(Torch2StepError, match="meta device"):
        prog.run(*spec.example_inputs)


def test_zero_tokens_is_a_clear_frontend_error(moe: torch2step.Program) -> None:
    with pytest.raises(FrontendError, match="size 0 on axis 0"):
        moe.report(torch.randn(0, 1, 64))


def test_report_text_states_the_chip_and_dtype(moe: torch2step.Program) -> None:
    rep = moe.report()
    text = str(rep)
    assert f"of {rep.cores_available:,} cores used" in text and "element type" in text
    assert rep.dtype == "fp32" and 0 < rep.hbm_bandwidth_fraction <= 1
    assert rep.hbm_bandwidth_fraction == pytest.approx(
        rep.hbm_bytes / rep.latency_cycles / rep.hbm_peak_bytes_per_cycle
    )
    assert rep.operator_breakdown() and rep.kind_breakdown()


def test_report_save_without_a_trace(moe: torch2step.Program, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = moe.report().save(tmp_path / "run")
    names = {p.name for p in out.iterdir()}
    assert {"summary.json", "units.csv", "operators.csv", "report.md", "roofline.png"} <= names
    assert "trace.json" not in names and "utilisation.png" not in names


def test_a_design_on_a_spatial_compile_is_refused() -> None:
    spec = models.get_layer("qwen3-moe", tiny=True, batch=2)
    with pytest.raises(LoweringError, match="design='basic' picks an ELK design"):
        torch2step.compile(spec.module, spec.example_inputs, design="basic")


def test_moe_and_attention_options_on_a_layer_without_them_are_refused() -> None:
    import torch

    m = torch.nn.Linear(8, 8, bias=False)
    with pytest.raises(LoweringError) as exc:
        torch2step.compile(m, (torch.randn(4, 8),), moe_lanes=2, tile_kv=32)
    msg = str(exc.value)
    assert "moe_lanes (for MoE experts), tile_kv (for attention)" in msg
    assert "its operators: Linear" in msg


def test_more_moe_lanes_than_experts_is_refused() -> None:
    spec = models.get_layer("mixtral-moe", tiny=True, batch=2)  # 8 experts
    with pytest.raises(LoweringError, match=r"moe_lanes=64 is more expert lanes than the layer's"):
        torch2step.compile(spec.module, spec.example_inputs, moe_lanes=64)


def test_an_input_of_another_float_dtype_is_said_once() -> None:
    import warnings

    import torch

    m = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8)
    prog = torch2step.compile(m, (x,))
    with pytest.warns(UserWarning, match="input input has dtype torch.float64; the program was"):
        y = prog.run(x.double())
    assert y.dtype == torch.float32 and torch.allclose(y, prog.run(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same input and dtype again: said already
        prog.run(x.double())
