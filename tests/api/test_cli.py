"""The command line: JSON reports of named layers and of an ONNX file; argument errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch_blocks import LoopMoE, seed_all

from torch2step.cli import main


def test_report_tiny_moe_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["report", "--layer", "qwen3-moe", "--batch", "8", "--tiny", "--json", "--quiet"]) == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert rep["latency_cycles"] > 0 and rep["hbm_bytes"] > 0
    assert sum(rep["dynamic"]["tokens_per_expert"]) == 8 * 2


def test_report_tiny_gqa_with_kv_trace(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["report", "--layer", "llama-gqa", "--batch", "4", "--tiny", "--json", "--quiet"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["latency_cycles"] > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["report", "--layer", "nope", "--batch", "2"], "invalid choice"),
        (["report", "--layer", "qwen3-moe", "--batch", "2", "--chip", "nope"], "step-sda"),
        (["report", "--layer", "qwen3-moe", "--batch", "0"], "positive"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], needle: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_import_onnx_prints_a_report(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("onnxscript")
    module = seed_all(LoopMoE(), 1).eval()
    path = tmp_path / "moe.onnx"
    torch.onnx.export(
        module,
        (torch.randn(6, 64),),
        dynamo=True,
        opset_version=20,
        dynamic_shapes=({0: torch.export.Dim("tokens")},),
        verbose=False,
    ).save(str(path))
    capsys.readouterr()
    assert main(["import-onnx", str(path), "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["latency_cycles"] > 0
    # on an inter-core-connected chip: kernel by kernel, the ELK report
    assert main(["import-onnx", str(path), "--chip", "ipu-hbm", "--json", "--quiet"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["cycles"] > 0 and rep["chip"] == "ipu-hbm" and rep["design"] == "elk_full"
    # --dim sizes one dynamic dimension by its name, --tokens the others
    assert main(["import-onnx", str(path), "--dim", "tokens=5", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["dynamic"]["tokens"] == 5
    with pytest.raises(SystemExit) as e:
        main(["import-onnx", str(path), "--dim", "batch=4", "--dim", "tokens=x", "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dim batch: not a dynamic dimension" in err
    assert "they are tokens" in err and "--dim 'tokens=x': write NAME=SIZE" in err


def test_missing_onnx_file_is_a_clear_error(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as e:
        main(["import-onnx", "/nonexistent/model.onnx"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "model.onnx" in err and "Traceback" not in err
