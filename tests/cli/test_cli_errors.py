"""Every bad input gives one line, the right exception class and a non-zero exit status."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hwmodel
import lowering.errors
import runtime.errors
import torch2step
from torch2step.cli import main
from torch2step.errors import InputError, Torch2StepError
from torch2step.named import parse_options, report_layer


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    return code, err


def _one_line(err: str) -> str:
    """The error's line (an input error of several problems lists them below it)."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[")]
    assert len(lines) == 1 or all(ln.startswith("  - ") for ln in lines[1:]), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "cls",
    [
        lowering.errors.ProgramError,
        runtime.errors.SimulationError,
        runtime.errors.DeadlockError,
        hwmodel.ChipConfigError,
        torch2step.FrontendError,
        torch2step.LoweringError,
        torch2step.ScheduleError,
        torch2step.errors.ElkError,
        InputError,
    ],
)
def test_every_error_class_derives_from_the_base(cls: type) -> None:
    assert issubclass(cls, Torch2StepError)
    assert torch2step.Torch2StepError is hwmodel.Torch2StepError


def _npz(path: Path, data: np.ndarray) -> str:
    np.savez(path, data=data)
    return str(path)


def test_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([5, -3, 7, 9]))
    moe = ["report", "--layer", "qwen3-moe", "--tiny", "--batch", "8", "-q"]
    gqa = ["report", "--layer", "llama-gqa", "--tiny", "--batch", "4", "-q"]
    cases = [
        (moe + ["--batch", "0"], "positive"),
        (["import-onnx", "x.onnx", "--tokens", "0"], "--tokens 0"),
        (["import-onnx", str(tmp_path / "none.onnx")], "no such ONNX file"),
        (moe + ["--chip", "step-sd"], "did you mean 'step-sda'"),
        (moe + ["--set", "hbm.chanels=4"], "no field 'hbm.chanels'"),
        (moe + ["--set", "hbm.channels=-1", "--set", "clock_ghz=0"], "2 problems"),
        (moe + ["--option", "moe_lanez=4"], "unknown compile option"),
        (moe + ["--option", "moe_lanes"], "KEY=VALUE"),
        (moe + ["--routing-trace", "nope_b3"], "unknown routing trace"),
        (
            moe + ["--routing-trace", _npz(tmp_path / "few.npz", np.array([[0, 1]] * 3))],
            "needs >= 8 tokens",
        ),
        (
            moe + ["--routing-trace", _npz(tmp_path / "big.npz", np.array([[9, 1]] * 8))],
            "expert id 9",
        ),
        (
            moe + ["--routing-trace", _npz(tmp_path / "fl.npz", np.full((8, 2), 1.7))],
            "expert ids must be integers",
        ),
        (gqa + ["--kv-trace", str(neg)], "KV length -3; lengths must be >= 0"),
        (gqa + ["--kv-trace", "b64/med"], "holds 64 requests"),
        (["chips", "--show", "ipu-hmb"], "did you mean 'ipu-hbm'"),
        # flags this report would not use are refused, not ignored
        (moe + ["--sim-layers", "4"], "--sim-layers K needs --hf-config and --layers N"),
        (moe + ["--trace-units", "4"], "--trace-units: options of the run directory's"),
        (
            moe + ["--kv-len", "100", "--kv-trace", "b8/med"],
            "--kv-len, --kv-trace: layer qwen3-moe",
        ),
        (gqa + ["--routing-trace", "qwen_b64"], "layer llama-gqa has no MoE router"),
        (["chips", "--set", "hbm.channels=64"], "add --show NAME"),
        (  # a flag the kernel-by-kernel report would ignore
            ["report", "--layer", "llama-gqa", "--batch", "4", "--chip", "ipu-hbm", "--tiny"],
            "--tiny: options of the spatial execution",
        ),
    ]
    for argv, needle in cases:
        code, err = _run(argv, capsys)
        assert code == 2, (argv, err)
        line = _one_line(err)
        assert needle in line, (argv, line)
        if needle == "2 problems":  # each problem is printed, with its value
            assert "  - clock_ghz = 0" in err and "  - hbm.channels = -1" in err, err


def test_pipeline_errors_are_one_line_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    # a chip far too small for the layer: a ScheduleError naming options that would help
    argv = ["report", "--layer", "qwen3-moe", "--tiny", "--batch", "8", "-q"]
    argv += ["--set", "noc.rows=4", "--set", "noc.cols=4"]
    code, err = _run(argv, capsys)
    assert code == 1, err
    first = err.splitlines()[0]
    assert first.startswith("torch2step: ScheduleError:") and "Traceback" not in err
    # the default expert lanes' fewer ones were tried (torch2step.fit): none is offered again
    assert "to make it fit, try (each needs fewer cores): a chip with more cores" in err
    assert "(expert lanes 4, 2 were tried: they do not fit either)" in err
    # on a 2x2 chip the router's matrix product alone does not fit: no expert option helps
    argv[-3:] = ["noc.rows=2", "--set", "noc.cols=2"]
    code, err = _run(argv, capsys)
    assert code == 1 and "layer operator n1_linear (Linear) alone needs" in err, err
    assert "moe_lanes" not in err and "a chip with more cores" in err


def test_a_decoder_whose_experts_do_not_fit_is_offered_expert_lanes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a MoE decoder layer's experts alone need more cores than a 4x4 chip: the options that
    # help are the experts' (moe_lanes), not the attention's; with the default lanes fewer
    # are tried at once (torch2step.fit), an explicit count is offered fewer
    argv = ["report", "--layer", "qwen3-moe-decoder", "--tiny", "--batch", "8", "-q"]
    argv += ["--set", "noc.rows=4", "--set", "noc.cols=4", "--option", "moe_lanes=0"]
    code, err = _run(argv, capsys)
    assert code == 1, err
    assert "layer operator n28_moeexperts (MoEExperts) alone needs" in err
    assert "to make it fit, try (each needs fewer cores): --option moe_lanes=4;" in err
    assert "tile_kv" not in err and "tried" not in err


def test_icca_chip_with_overrides_runs_kernel_by_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    # an ipu-hbm with fields overridden is still an ICCA chip: the ELK planner's error, one
    # line naming the operator
    argv = ["report", "--layer", "llama-gqa", "--batch", "8", "-q"]
    argv += ["--chip", "ipu-hbm", "--set", "core.sram_bytes=4096"]
    code, err = _run(argv, capsys)
    assert code == 1, err
    line = _one_line(err)
    assert line.startswith("torch2step: ElkError: operator 'qkv_proj':"), line
    assert "4096 bytes of SRAM on ipu-hbm[core.sram_bytes=4096]" in line


def test_report_layer_api_raises_input_error() -> None:
    with pytest.raises(InputError, match="did you mean 'qwen3-moe'"):
        report_layer("qwen3-mo", 8)
    with pytest.raises(InputError, match="positive"):
        report_layer("qwen3-moe", -3, tiny=True)
    assert parse_options(["moe_lanes=4", "tile_cols=none"]) == {"moe_lanes": 4, "tile_cols": None}


def test_parse_options_takes_every_spatial_compile_option_by_its_type() -> None:
    # the strategy options and the string / boolean options README documents, typed
    got = parse_options(
        [
            "strategy=auto",
            "onchip_budget=4000000",
            "moe_lane_assign=consecutive",
            "attn_assign=coarse",
            "stream_rows=false",
            "moe_lanes=2",
            "tile_cols=none",
        ]
    )
    assert got == {
        "strategy": "auto",
        "onchip_budget": 4_000_000,
        "moe_lane_assign": "consecutive",
        "attn_assign": "coarse",
        "stream_rows": False,
        "moe_lanes": 2,
        "tile_cols": None,
    }
    assert parse_options({"strategy": "auto", "attn_assign": "dynamic"}) == {
        "strategy": "auto",
        "attn_assign": "dynamic",
    }
    # a bad value names the option, the value and the values allowed
    for items, want in (
        (["strategy=best"], "--option strategy='best': must be one of auto, default or none"),
        (["moe_lane_assign=rr"], "moe_lane_assign='rr': must be one of dispatch, consecutive"),
        (["stream_rows=maybe"], "stream_rows='maybe': must be true or false"),
        (["moe_lanes=two"], "moe_lanes='two': must be an integer or none"),
        (["tile_rows=none"], "tile_rows='none': must be an integer"),
        ({"tile_rows": "32"}, "tile_rows='32': must be an integer"),
        ({"stream_rows": 1}, "stream_rows=1: must be true or false"),
        (["moe_lanez=4"], "moe_lanez: unknown compile option (did you mean moe_lanes?)"),
    ):
        with pytest.raises(InputError) as exc:
            parse_options(items)
        assert want in str(exc.value), exc.value


def test_option_kinds_are_what_compile_takes() -> None:
    # every LowerOptions field and the strategy search's options, each choice one the
    # lowering accepts and nothing else
    import dataclasses

    from torch2step.errors import LoweringError
    from torch2step.lower import LowerOptions
    from torch2step.named import OPTION_CHOICES, option_kinds

    kinds = option_kinds()
    fields = {f.name for f in dataclasses.fields(LowerOptions)}
    assert fields | {"strategy", "onchip_budget", "compute_budget"} == set(kinds)
    for key, choices in OPTION_CHOICES.items():
        assert kinds[key].startswith("str"), key
        if key in fields:
            for c in choices:
                LowerOptions(**{key: c})
            with pytest.raises(LoweringError):
                LowerOptions(**{key: "bogus"})
    assert all(k in OPTION_CHOICES for k, v in kinds.items() if v.startswith("str"))


@pytest.mark.parametrize(
    "options",
    [["strategy=auto"], ["moe_lane_assign=consecutive", "moe_lanes=2"]],
    ids=["strategy", "consecutive-lanes"],
)
def test_report_takes_strategy_and_string_options(
    options: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    argv = ["report", "--layer", "qwen3-moe", "--batch", "8", "--tiny", "--json", "-q"]
    for o in options:
        argv += ["--option", o]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0
    rep = json.loads(out[out.index("{") :])
    assert rep["latency_cycles"] > 0
    for o in options:
        key, _, value = o.partition("=")
        assert str(rep["options"][key]) == value
