"""N identical decoder layers as one repeated body: evaluation with each layer's weights equals
the layers run one after another in PyTorch; a compiled stack runs and reports as N times its
body; a config's stack holds one body however many layers; layers that differ and families that
are not raised are refused, naming the layer."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch2step  # noqa: E402
from models.decoder import DecoderStep, decode_inputs, decoder_step, tiny_config  # noqa: E402
from torch2step.errors import FrontendError, LoweringError  # noqa: E402
from torch2step.frontend import from_torch  # noqa: E402
from torch2step.frontend.hf_config import stack_from_config, stack_from_model  # noqa: E402
from torch2step.layers import Repeat, evaluate  # noqa: E402
from torch2step.layers.stack import stack_graph  # noqa: E402


def _reference(steps, x, ks, vs):
    h, new_k, new_v = x, [], []
    with torch.no_grad():
        for step, k, v in zip(steps, ks, vs):
            h, k2, v2 = step(h, k, v)
            new_k.append(k2)
            new_v.append(v2)
    return h, torch.stack(new_k), torch.stack(new_v)


@pytest.fixture(scope="module")
def llama():
    cfg = tiny_config("llama")
    steps = [decoder_step(cfg, device="cpu", seed=i) for i in range(3)]
    x, k, v = decode_inputs(cfg, 3, 5)
    return cfg, steps, from_torch(steps[0], (x, k, v))


def test_stack_with_each_layers_weights_equals_pytorch(llama) -> None:
    cfg, steps, body = llama
    weights = [{n: p.detach() for n, p in s.named_parameters()} for s in steps]
    g = stack_graph(body, 3, layer_params=weights)
    gen = torch.Generator().manual_seed(1)
    for past in (1, 7):
        x = torch.randn(2, 1, 64, generator=gen)
        ks, vs = (torch.randn(3, 2, 2, past, 16, generator=gen) for _ in range(2))
        for got, want in zip(evaluate(g, x, ks, vs), _reference(steps, x, ks, vs)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_compiled_stack_runs_and_reports_as_n_bodies(llama) -> None:
    cfg, steps, body = llama
    g = stack_graph(body, 3)
    x, k, v = decode_inputs(cfg, 2, 4, seed=3)
    ks, vs = torch.stack([k, k + 1, k - 1]), torch.stack([v, -v, v * 2])
    prog = torch2step.compile(g, (x, ks, vs))
    for got, want in zip(prog.run(x, ks, vs), _reference([steps[0]] * 3, x, ks, vs)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    rep, one = prog.report(x, ks, vs), prog.body.report(x, k, v)
    assert rep.latency_cycles == 3 * one.latency_cycles
    assert rep.hbm_bytes == 3 * one.hbm_bytes and rep.peak_onchip_bytes == one.peak_onchip_bytes
    assert rep.dynamic["layers"] == 3
    with pytest.raises(LoweringError, match="sim_layers= chooses the simulated layers"):
        prog.report(x, ks, vs, sim_layers=2)  # a kernel step's option: named, not a TypeError
    text = str(prog)
    assert text.count("Repeat[count=3") == 1 and text.count("layer.mlp.down_proj.weight:") == 1


def test_config_stack_holds_one_body() -> None:
    cfg = tiny_config("qwen3_moe", num_hidden_layers=32)
    g = stack_from_config(cfg, check=False)
    ((node),) = g.nodes
    assert isinstance(node.op, Repeat) and node.op.count == 32
    assert str(g.types["past_k"].shape[0]) == "32"
    one = str(node.op.body)
    assert len(str(g)) < len(one) + 1000  # printed once, not 32 times


def test_layers_that_differ_are_refused_naming_the_layer() -> None:
    cfg = tiny_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[2])
    with pytest.raises(FrontendError, match=r"layer 2 \(Qwen3MoeDecoderLayer\) is not identical"):
        stack_from_config(cfg)


def test_family_not_raised_is_named() -> None:
    with pytest.raises(FrontendError, match="model_type 'gpt2' is not a raised decoder family"):
        stack_from_config({"model_type": "gpt2", "n_layer": 2})


def test_cli_reports_a_config_of_n_layers(tmp_path, capsys) -> None:
    import json

    from models.decoder import tiny_config_dict
    from torch2step.cli import main

    cfg = tiny_config_dict("llama", num_hidden_layers=6)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert (
        main(["report", "--hf-config", str(path), "--layers", "6", "--batch", "2", "--json"]) == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert rep["layer"] == "llama_decoder_x6" and rep["dynamic"]["layers"] == 6


@pytest.mark.slow
def test_model_with_weights_compiles_as_a_stack_equal_to_pytorch() -> None:
    from models.decoder import model_step

    cfg = tiny_config("qwen3_moe", num_hidden_layers=3)
    model = model_step(cfg, device="cpu", causal_lm=False).model
    g = stack_from_model(model)
    (node,) = g.nodes
    assert node.op.count == 3 and len(node.op.layer_params) == 3
    base = model
    steps = [DecoderStep(layer, base.rotary_emb).eval() for layer in base.layers]
    x, k, v = decode_inputs(cfg, 2, 5, seed=4)
    ks, vs = torch.stack([k, -k, k * 0.5]), torch.stack([v, v + 1, -v])
    prog = torch2step.compile(g, (x, ks, vs))
    want = _reference(steps, x, ks, vs)
    for got in (evaluate(g, x, ks, vs), prog.run(x, ks, vs)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_stacks_body_searches_the_strategies_it_is_given(llama) -> None:
    """``strategy="auto"`` on a stack compiled for a spatial chip searches its body's STeP §5
    strategies (it is not dropped on the way to the body)."""
    cfg, _, body = llama
    g = stack_graph(body, 3)
    x, k, v = decode_inputs(cfg, 2, 4, seed=3)
    ks, vs = torch.stack([k] * 3), torch.stack([v] * 3)
    prog = torch2step.compile(g, (x, ks, vs), strategy="auto")
    assert prog.body.strategy_table.startswith("strategy=auto: ")
