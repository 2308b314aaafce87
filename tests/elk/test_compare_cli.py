"""``torch2step compare``: both execution models of one layer on the same inputs — the served
dtype and one KV length for every request — side by side."""

from __future__ import annotations

import json

import pytest

from torch2step.cli import main
from torch2step.config_jobs import JOBS_ENV
from torch2step.named import report_layer


def test_compare_runs_both_executions_of_the_same_layer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(JOBS_ENV, "1")  # the spatial report in this process: its program is reused
    argv = ["compare", "--layer", "llama-gqa", "--batch", "4", "--kv-len", "256", "--json", "-q"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["dtype"] == "bf16" and out["kv_len"] == 256
    assert out["spatial_notes"] == ["KV lengths: every request 256 (uniform)"]
    # the spatial row is the report of that layer: bf16, every request at 256 rows
    run = report_layer("llama-gqa", 4, "step-sda", kv_len=256, dtype="bf16")
    assert out["spatial"]["cycles"] == run.report.latency_cycles
    assert out["spatial"]["chip"] == "step-sda" and out["kernel"]["chip"] == "ipu-hbm"
    assert out["kernel"]["cycles"] > 0 and 0 < out["kernel"]["hbm_util"] <= 1
    assert run.report.dynamic["past"] == 256  # the cache the requests attend: --kv-len rows
    # each side against its own chip's bound: the chips differ (HBM 1.64 vs 4.00 TB/s)
    s, k = out["spatial"], out["kernel"]
    assert s["of_bound"] == pytest.approx(run.report.roofline_fraction)
    assert 0 < k["of_bound"] <= 1 and k["bound_us"] <= k["latency_us"]
    assert (s["clock_ghz"], k["clock_ghz"]) == (1.6, 1.33)
    assert s["hbm_tb_s"] == pytest.approx(1.6384) and k["hbm_tb_s"] == pytest.approx(4.0, rel=0.01)


def test_compare_chips_take_overrides_and_refuse_bad_input(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(JOBS_ENV, "1")
    base = ["compare", "--layer", "llama-gqa", "--batch", "4", "--kv-len", "256", "-q"]
    with pytest.raises(SystemExit) as exc:  # an unknown design: a usage error, nothing run
        main(base + ["--design", "bogus"])
    assert exc.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(base + ["--kernel-chip", "ipu-hmb"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kernel-chip/--kernel-set: " in err and "ipu-hbm" in err
    # an override of the kernel chip: its label says so and its latency follows it
    assert main(base + ["--json", "--kernel-set", "hbm.channels=16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kernel"]["chip"] == "ipu-hbm[hbm.channels=16]"
    assert main(base + ["--json"]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kernel"]["cycles"] > full["kernel"]["cycles"]  # a quarter of the channels
    assert out["spatial"]["cycles"] == full["spatial"]["cycles"]


def test_a_uniform_kv_length_and_a_kv_trace_are_one_choice() -> None:
    from torch2step.errors import InputError

    with pytest.raises(InputError, match="give one"):
        report_layer("llama-gqa", 64, kv_len=256, kv_trace="b64/med")
    with pytest.raises(InputError, match="positive"):
        report_layer("llama-gqa", 4, kv_len=0)


def test_moe_operators_follow_the_routing_they_are_given() -> None:
    import numpy as np

    from models.registry import LAYERS
    from torch2step.errors import LoweringError
    from torch2step.kernel.layers import moe_active, registered_layer_ops

    cfg = LAYERS["qwen3-moe"].config
    tokens, k = 16, cfg.top_k
    skewed = np.tile(np.arange(k), (tokens, 1))  # every token picks experts 0..k-1
    assert moe_active(cfg, tokens, skewed) == k
    assert moe_active(cfg, tokens) == round(cfg.num_experts * (1 - (1 - k / cfg.num_experts) ** tokens))
    ops = {o.name: o for o in registered_layer_ops("qwen3-moe", tokens, routing=skewed)}
    rows, width = ops["experts0_gate_up"].dims[0], ops["experts0_gate_up"].dims[2]
    assert width == 2 * cfg.intermediate_size * k and rows == tokens  # k experts, every token
    assert "experts1_gate_up" not in ops  # k experts are one grouped operator
    with pytest.raises(LoweringError, match="expected"):
        registered_layer_ops("qwen3-moe", tokens, routing=skewed[:3])


def test_moe_experts_are_grouped_into_operators_that_fit_the_chip() -> None:
    from elk.ops import EXPERT_OP_BYTES, EXPERTS_PER_OP, expert_groups
    from hwmodel import load_chip
    from models.registry import LAYERS
    from torch2step.kernel.layers import registered_layer_ops

    # Qwen3-30B-A3B: small experts, grouped by EXPERTS_PER_OP; Mixtral-8x7B: one expert's
    # gate and up weights (235 MB) are an operator of their own
    assert expert_groups(82, 2048, 768) == [28, 27, 27] and EXPERTS_PER_OP == 32
    assert expert_groups(6, 4096, 14336) == [1] * 6
    assert expert_groups(3, 4096, 14336, "fp32") == [1, 1, 1]
    chip = load_chip("ipu-hbm")
    capacity = chip.num_cores * chip.core.sram_bytes
    for name in ("qwen3-moe", "mixtral-moe"):
        cfg = LAYERS[name].config
        ops = registered_layer_ops(name, 64)
        ups = [o for o in ops if o.name.endswith("_gate_up")]
        experts = sum(o.dims[2] for o in ups) // (2 * cfg.intermediate_size)
        assert experts == round(cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** 64))
        for o in ups:  # each fits the chip with room for the next preload
            assert o.hbm_bytes <= EXPERT_OP_BYTES < capacity / 2


def test_compare_routes_the_kernel_side_as_the_spatial_side() -> None:
    import numpy as np

    from models import get_layer
    from models.registry import LAYERS
    from torch2step.cli_compare import _moe_routing
    from torch2step.named import _routing

    meta = get_layer("qwen3-moe", batch=32, device="meta").metadata
    want, _ = _routing(LAYERS["qwen3-moe"], meta, "auto")
    got, notes = _moe_routing(LAYERS["qwen3-moe"], "qwen3-moe", 32, compared=True)
    assert want is not None and np.array_equal(got, want)
    n = len(np.unique(want))
    timed = (
        "; grouped operators each timed at its busiest expert's rows, their weights preloaded "
        "once topk has chosen them (ELK §7 'Apply ELK to MoE')"
    )
    assert notes == [
        f"experts: {n} of 128 active, as the spatial side routes (the first 32 tokens of trace "
        f"qwen_b1024){timed}"
    ]
    # a report of the kernel execution alone has no spatial side to name
    _, alone = _moe_routing(LAYERS["qwen3-moe"], "qwen3-moe", 32)
    assert alone == [f"experts: {n} of 128 active (the first 32 tokens of trace qwen_b1024){timed}"]


def test_a_registered_decoder_runs_kernel_by_kernel_as_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``report --layer llama-decoder --chip ipu-hbm`` and ``compare`` plan the decoder layer
    as the one-layer decode step of its config.json (what ``--hf-config`` compiles)."""
    import torch2step
    from hwmodel.presets import load_chip
    from models.registry import HF_CONFIGS
    from torch2step.cli_compare import kernel_layer_report

    seen = {}

    class Prog:
        def report(self, tokens: int) -> str:
            return f"report of {tokens} tokens"

    def compile_config(path, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.update(kw, path=path)
        return Prog()

    monkeypatch.setattr(torch2step, "compile_config", compile_config)
    chip = load_chip("ipu-hbm")
    assert kernel_layer_report("llama-decoder", 8, chip, 512) == "report of 8 tokens"
    assert seen["path"] == HF_CONFIGS / "llama-3-8b.json"
    assert (seen["batch"], seen["past"], seen["execution"], seen["chip"]) == (8, 512, "kernel", chip)


def test_default_execution_follows_the_chip_description() -> None:
    # compile and report run a layer as the chip's description says (Chip.execution)
    from hwmodel import ChipConfigError, load_chip, with_mesh_shape, with_overrides

    ipu, mesh = load_chip("ipu-hbm"), load_chip("mesh")
    assert ipu.execution == mesh.execution == "kernel"
    assert with_overrides(ipu, ["core.sram_bytes=4096"]).execution == "kernel"
    assert with_mesh_shape(mesh, 4, 8).execution == "kernel"
    for name in ("step-sda", "step-paper", "sn40l-like"):
        assert load_chip(name).execution == "spatial"
    # any chip can declare itself inter-core-connected
    assert with_overrides(load_chip("step-sda"), ["execution=kernel"]).execution == "kernel"
    with pytest.raises(ChipConfigError, match="execution = 'dataflow'"):
        with_overrides(ipu, ["execution=dataflow"])
