"""A kernel program is compiled for the example inputs' sizes: ``run`` and ``report`` check
their inputs against them and refuse, with a :class:`torch2step.Torch2StepError` naming the
input, what was expected and what to do, what they cannot take; nothing is ignored."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import torch2step
from torch2step.errors import FrontendError, LoweringError
from torch2step.kernel.program import KernelProgram


@pytest.fixture(scope="module")
def mlp() -> tuple[nn.Module, torch.Tensor, KernelProgram]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128, bias=False), nn.SiLU(), nn.Linear(128, 64, bias=False))
    x = torch.randn(8, 64)
    prog = torch2step.compile(m, (x,), chip="ipu-hbm")
    assert isinstance(prog, KernelProgram)
    return m, x, prog


def test_run_takes_other_values_of_the_compiled_sizes(mlp) -> None:
    m, x, prog = mlp
    x3 = torch.randn(8, 64)
    with torch.no_grad():
        torch.testing.assert_close(prog.run(x3), m(x3), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(prog.run(), m(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape, differ",
    [((5, 64), "8 rows, not 5"), ((8, 65), "size 64 on axis 1, not 65"), ((8, 64, 1), "2 dims")],
)
def test_inputs_of_other_sizes_are_refused_as_static(mlp, shape, differ) -> None:
    _, _, prog = mlp
    for call in (prog.run, prog.report):
        with pytest.raises(FrontendError) as err:
            call(torch.randn(*shape))
        msg = str(err.value)
        assert isinstance(err.value, torch2step.Torch2StepError)
        assert f"has shape {list(shape)}" in msg and "compiled for shape [8, 64]" in msg
        assert differ in msg and "static sizes" in msg and "compile again" in msg


def test_a_refused_input_changes_no_later_result(mlp) -> None:
    m, x, prog = mlp
    before = prog.report().cycles
    with pytest.raises(FrontendError):
        prog.run(torch.randn(5, 64))
    assert prog.report().cycles == before
    with torch.no_grad():
        torch.testing.assert_close(prog.run(), m(x), rtol=1e-4, atol=1e-4)


def test_extra_missing_and_wrong_kinds_of_inputs_are_refused(mlp) -> None:
    _, x, prog = mlp
    with pytest.raises(FrontendError, match=r"run\(\) takes 1 input \(input\).*got 2"):
        prog.run(x, x)
    with pytest.raises(FrontendError, match=r"report\(\) takes 1 input .*got 2"):
        prog.report(x, x)
    with pytest.raises(FrontendError, match="must be a torch.Tensor, got ndarray"):
        prog.run(x.numpy())
    with pytest.raises(FrontendError, match="has dtype torch.int64.*compiled for torch.float32"):
        prog.run(torch.zeros(8, 64, dtype=torch.int64))
    with pytest.raises(FrontendError, match="meta device"):
        prog.run(torch.empty(8, 64, device="meta"))


def test_report_takes_inputs_of_the_compiled_sizes_and_tokens_by_keyword(mlp) -> None:
    _, x, prog = mlp
    base = prog.report().cycles
    assert prog.report(x).cycles == base  # the timing depends on the sizes only
    assert prog.report(torch.randn(8, 64), tokens=8).cycles == base
    assert prog.report(torch.empty(8, 64, device="meta")).cycles == base  # shapes suffice
    with pytest.raises(FrontendError, match=r"got int; the batch's token count is a keyword"):
        prog.report(4)  # type: ignore[arg-type]


def test_report_routing_of_a_layer_without_experts_or_with_weights_is_refused(mlp) -> None:
    _, _, prog = mlp
    with pytest.raises(LoweringError, match="this layer has no experts"):
        prog.report(routing=np.array([[0, 1]]))


def _moe_config(tmp_path: Any) -> Any:
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from models.decoder import tiny_config_dict

    path = tmp_path / "config.json"
    cfg = tiny_config_dict("qwen3_moe", num_experts=16, num_experts_per_tok=2)
    path.write_text(json.dumps(cfg))
    return path


def test_report_routing_of_a_config_is_the_one_compiled(tmp_path) -> None:
    path = _moe_config(tmp_path)
    ids = np.array([[0, 5], [5, 9]])
    prog = torch2step.compile_config(path, batch=2, past=8, chip="ipu-hbm", routing=ids)
    assert isinstance(prog, KernelProgram) and prog.graph.shapes_only
    base = prog.report(tokens=2).cycles
    assert prog.report(tokens=2, routing=ids.copy()).cycles == base
    assert prog.report(tokens=2, routing=torch.tensor(ids)).cycles == base
    with pytest.raises(LoweringError, match=r"compiled with other expert ids.*routing=ids"):
        prog.report(routing=np.array([[1, 2], [3, 4]]))
    with pytest.raises(LoweringError, match="needs weights"):
        prog.run(*prog.example_inputs)  # shapes only, with or without inputs
    uniform = torch2step.compile_config(path, batch=2, past=8, chip="ipu-hbm")
    assert isinstance(uniform, KernelProgram)
    with pytest.raises(LoweringError, match="compiled with no routing="):
        uniform.report(routing=ids)


def test_report_routing_of_a_moe_layer_with_weights_is_refused() -> None:
    from models.registry import get_layer

    m, inp, ds, _ = get_layer("qwen3-moe", tiny=True, batch=4)
    prog = torch2step.compile(m, inp, chip="ipu-hbm", dynamic_shapes=ds)
    assert isinstance(prog, KernelProgram) and prog.graph.moe
    with pytest.raises(LoweringError, match="loads every expert.*without routing="):
        prog.report(routing=np.array([[0, 1]] * 4))


def test_a_config_program_knows_its_batch_for_the_time_per_token() -> None:
    from models.decoder import tiny_config_dict
    from torch2step.frontend.hf_config import compile_config

    prog = compile_config(tiny_config_dict("llama"), batch=4, past=16, chip="ipu-hbm")
    rep = prog.report()
    assert prog.tokens == 4 and rep.tokens == 4
    assert "us per token of the batch" in str(rep)
    assert prog.report(tokens=2).tokens == 2  # given: it wins
    stack = compile_config(tiny_config_dict("llama"), batch=4, past=16, chip="ipu-hbm", layers=2)
    assert "us per token of the batch" in str(stack.report())


def test_a_kernel_stack_checks_its_run_inputs() -> None:
    from models.decoder import decode_inputs, decoder_step, tiny_config
    from torch2step.frontend import from_torch
    from torch2step.layers.stack import stack_graph

    cfg = tiny_config("llama")
    x, k, v = decode_inputs(cfg, 2, 4, seed=3)
    body = from_torch(decoder_step(cfg, device="cpu", seed=0), (x, k, v))
    ks, vs = torch.stack([k, k + 1]), torch.stack([v, -v])
    prog = torch2step.compile(stack_graph(body, 2), (x, ks, vs), chip="ipu-hbm")
    with pytest.raises(FrontendError, match="takes 3 inputs"):
        prog.run(x, ks)
    with pytest.raises(FrontendError, match="compiled for shape"):
        prog.run(x, ks[:, :1], vs[:, :1])
