"""Whole HuggingFace decoder layers (Llama, Qwen3, Qwen3-MoE, Mixtral, OLMoE, Starcoder2) as
decode steps: one compile serves every batch and KV length, ``run()`` equals PyTorch with
uniform and ragged caches; a config alone (no weights) compiles and reports, and ``run()`` then
asks for weights."""

from __future__ import annotations

import json

import pytest
import torch

import models
import torch2step
from models.decoder import DECODER_LAYERS, decode_inputs, decoder_step, tiny_config
from torch2step.layers import Attention, MoEExperts, Rotary

torch.set_num_threads(1)


def _close(got, want) -> None:
    for g, w in zip(got, want):
        scale = float(w.abs().max()) or 1.0
        torch.testing.assert_close(g, w, atol=1e-4 * scale, rtol=0)


@pytest.fixture(scope="module", params=sorted(DECODER_LAYERS))
def compiled(request):
    cfg = tiny_config(request.param)
    step = decoder_step(cfg, device="cpu", seed=1)
    prog = torch2step.compile(step, decode_inputs(cfg, 3, 5), chip="step-sda")
    return request.param, cfg, step, prog


def test_decoder_layer_raises_whole(compiled) -> None:
    kind, _, _, prog = compiled
    ops = {type(n.op) for n in prog.layer.nodes}
    assert {Attention, Rotary} <= ops
    assert (MoEExperts in ops) == (kind in ("mixtral", "qwen3_moe", "olmoe"))


@pytest.mark.parametrize(("batch", "past"), [(1, 1), (5, 3)])
def test_one_compile_serves_every_batch_and_kv_length(compiled, batch: int, past: int) -> None:
    _, cfg, step, prog = compiled
    ins = decode_inputs(cfg, batch, past, seed=batch + past)
    with torch.no_grad():
        want = step(*ins)
    _close(prog.run(*ins), want)


def test_ragged_kv_lengths() -> None:
    cfg = tiny_config("mixtral")
    step = decoder_step(cfg, device="cpu", seed=2)
    prog = torch2step.compile(step, decode_inputs(cfg, 3, 6, kv_lengths=[1, 6, 3]), chip="step-sda")
    for lens in ([0, 1, 9, 4], [1, 1, 1, 1]):
        ins = decode_inputs(cfg, 4, 9, seed=3, kv_lengths=lens)
        with torch.no_grad():
            want = step(*ins)
        _close(prog.run(*ins), want)


def test_registry_names_the_decoder_layers() -> None:
    names = {"llama-decoder", "qwen3-decoder", "mixtral-decoder", "qwen3-moe-decoder"}
    assert names <= set(models.LAYERS)
    full = models.get_layer("qwen3-moe-decoder", batch=2, kv_len=8)
    assert full.example_inputs[0].is_meta and full.metadata["kind"] == "decoder"
    experts = full.module.layer.mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (128, 2 * 768, 2048)  # Qwen3-30B-A3B
    assert full.metadata["param_count"] > 600_000_000  # shapes only: no memory


def test_config_without_weights_reports_and_refuses_to_run(tmp_path) -> None:
    cfg = {
        "model_type": "mixtral", "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    prog = torch2step.compile_config(path, batch=4, past=16)
    assert all(p.is_meta for p in prog.layer.params.values())
    rep = prog.report()
    assert rep.latency_cycles > 0
    with pytest.raises(torch2step.Torch2StepError, match="needs weights"):
        prog.run()


@pytest.mark.parametrize(
    ("said", "asked", "want"),
    [("bfloat16", None, torch.bfloat16), ("float16", None, torch.float16),
     (None, None, torch.float32), ("bfloat16", "fp32", torch.float32)],
)  # fmt: skip
def test_served_dtype_is_the_configs_unless_asked(said, asked, want) -> None:
    # a config's own torch_dtype decides what its weights, caches and activations are timed
    # and counted in; dtype= overrides it; no dtype in the config is what HF loads: float32
    from models.decoder import hf_config
    from torch2step.frontend.hf_config import served_dtype

    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    if said is not None:
        cfg["torch_dtype"] = said
    assert served_dtype(hf_config(cfg), asked) == want


def test_config_is_compiled_in_the_dtype_it_is_served_in(tmp_path) -> None:
    cfg = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 64, "torch_dtype": "bfloat16",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    from torch2step.frontend.hf_config import from_hf_config

    g = from_hf_config(path)  # with its stand-in, raised in the same dtype
    assert {g.types[k].dtype for k in g.params} == {"bf16"}
    assert {g.types[v].dtype for v in g.inputs} >= {"bf16"}
    kernel = torch2step.compile_config(
        path, batch=2, past=8, layers=2, chip="ipu-hbm", check=False
    )  # fmt: skip
    assert kernel.graph.dtype == "bf16"


def test_config_dtype_must_be_a_float_type(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(torch2step.FrontendError, match="dtype 'int8': choose from"):
        torch2step.compile_config(path, dtype="int8")


def test_config_of_an_unraised_family_is_one_clear_error(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(torch2step.FrontendError, match="model_type 'gpt2' is not a raised"):
        torch2step.compile_config(path)


def test_cli_reports_a_config_file(tmp_path, capsys) -> None:
    from torch2step.cli import main

    cfg = {
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "head_dim": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 36,
        "vocab_size": 64,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["report", "--hf-config", str(path), "--batch", "2", "--quiet"]) == 0
    assert "latency" in capsys.readouterr().out


@pytest.mark.parametrize("ragged", [False, True])
def test_prefill_raises_to_causal_attention(ragged: bool) -> None:
    """A prompt chunk of T tokens after the cache raises to one causal Attention for every
    T >= 2 and evaluates equal to PyTorch."""
    from torch2step.frontend import from_torch
    from torch2step.layers import evaluate

    cfg = tiny_config("qwen3_moe")
    step = decoder_step(cfg, device="cpu", seed=4)
    graph = from_torch(step, _prefill_inputs(cfg, ragged, 3, 7, 5))
    (att,) = graph.ops(Attention)
    assert att.op.causal
    for b, t, p in ((2, 7, 9), (3, 64, 4), (2, 2, 1)):
        ins = _prefill_inputs(cfg, ragged, b, t, p)
        with torch.no_grad():
            want = step(*ins)
        _close(evaluate(graph, *ins), want)


def _prefill_inputs(cfg, ragged: bool, b: int, t: int, p: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(b * 100 + t)
    x = torch.randn(b, t, cfg.hidden_size, generator=gen)
    lens = None
    if ragged:
        lens = torch.randint(0, p + 1, (b,), generator=gen)
        lens[0] = min(1, p)  # a KV length of 1 in every ragged case
    return (x, *decode_inputs(cfg, b, p, seed=t, kv_lengths=lens)[1:])


_PREFILL_CASES = ((2, 7, 9), (3, 64, 4), (2, 2, 1), (4, 1, 3), (1, 1, 1))


@pytest.mark.parametrize(
    ("kind", "ragged"),
    [
        ("qwen3_moe", True),
        ("qwen3_moe", False),
        ("llama", True),
        ("qwen3", True),
        ("mixtral", True),
        ("olmoe", True),
    ],
)
def test_prefill_runs_like_pytorch(kind: str, ragged: bool) -> None:
    """One compile of a prefill step serves every batch, T (1, 2, 7, 64) and KV length
    (ragged, including 1): ``run()`` equals PyTorch and a report simulates it."""
    cfg = tiny_config(kind)
    step = decoder_step(cfg, device="cpu", seed=4)
    prog = torch2step.compile(step, _prefill_inputs(cfg, ragged, 3, 7, 5), chip="step-sda")
    for b, t, p in _PREFILL_CASES:
        ins = _prefill_inputs(cfg, ragged, b, t, p)
        with torch.no_grad():
            want = step(*ins)
        _close(prog.run(*ins), want)
    rep = prog.report(*_prefill_inputs(cfg, ragged, 2, 7, 9))
    assert rep.latency_cycles > 0


def test_two_layer_causal_lm_decode_step() -> None:
    """A 2-layer ``Qwen3MoeForCausalLM`` decode step (embedding, layers, norm, LM head)."""
    from models.decoder import model_dynamic_shapes, model_inputs, model_step

    cfg = tiny_config("qwen3_moe", num_hidden_layers=2)
    step = model_step(cfg, device="cpu", seed=5)
    prog = torch2step.compile(
        step, model_inputs(cfg, 3, 5), chip="step-sda", dynamic_shapes=model_dynamic_shapes()
    )
    assert len(list(prog.layer.ops(MoEExperts))) == len(list(prog.layer.ops(Attention))) == 2
    assert prog.layer.types[prog.layer.outputs[0]].shape[-1] == cfg.vocab_size
    for b, p in ((2, 9), (4, 1)):
        ins = model_inputs(cfg, b, p, seed=b)
        with torch.no_grad():
            want = step(*ins)
        _close(prog.run(*ins), want)


def test_bf16_decoder_keeps_its_rounded_rope_table() -> None:
    # module.to(bfloat16) rounds the inv_freq buffer; the Rotary op holds the table in bf16
    # and computes the angles from those rounded values, as the module does
    cfg = tiny_config("qwen3")
    step = decoder_step(cfg, device="cpu", seed=4).to(torch.bfloat16)
    ins = decode_inputs(cfg, 3, 40, seed=5, kv_lengths=[1, 40, 17])
    ins = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in ins)
    prog = torch2step.compile(step, ins, chip="step-sda")
    rot = list(prog.layer.ops(Rotary))
    assert rot and all(n.op.table_dtype == "bfloat16" for n in rot)
    with torch.no_grad():
        want = step(*ins)
    for g, w in zip(prog.run(*ins), want):
        scale = float(w.float().abs().max()) or 1.0
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2 * scale, rtol=0)


def test_cli_config_report_says_how_a_moe_layer_was_routed(tmp_path, capsys) -> None:
    import numpy as np

    from torch2step.cli import main

    cfg = tiny_config("qwen3_moe").to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg, default=str))
    argv = ["report", "--hf-config", str(path), "--batch", "3", "--quiet", "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert any("the model's router on stand-in values" in n for n in rep["notes"])
    ids = np.array([[0, 1], [0, 1], [2, 1]])  # top-2 of the tiny config's 4 experts
    np.save(tmp_path / "ids.npy", ids)
    assert main([*argv, "--routing-trace", str(tmp_path / "ids.npy")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["dynamic"]["tokens_per_expert"] == [2, 3, 1, 0]
    assert any(n.startswith("routing: trace ") for n in rep["notes"])
    # the API says it too: a config's router chooses on stand-in values
    rep = torch2step.compile_config(path, batch=3).report()
    assert any(n.startswith("routing: the router's choice on stand-in values") for n in rep.notes)
    # a dense model has no router to route
    dense = {**cfg, "model_type": "qwen3"}
    (tmp_path / "dense.json").write_text(json.dumps(dense, default=str))
    bad = ["report", "--hf-config", str(tmp_path / "dense.json"), "--batch", "3", "--quiet"]
    with pytest.raises(SystemExit) as stop:
        main([*bad, "--routing-trace", "qwen_b64"])
    assert stop.value.code == 2
    assert "the model has no MoE router" in capsys.readouterr().err
