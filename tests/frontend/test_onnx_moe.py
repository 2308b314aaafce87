"""ONNX import of MoE blocks exported by the dynamo exporter (opset 20), three spellings:
HF ``batched_mm`` (expert weights gathered per token), HF ``grouped_mm`` (tokens sorted by expert,
exported with :func:`grouped_mm_translation_table`) and a user-written loop over experts.  Each
must raise to one TopKRouting + one MoEExperts holding the module's own weights and compute what
the PyTorch module computes."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("onnxscript")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from torch2step.errors import UnsupportedOperatorError  # noqa: E402
from torch2step.frontend.engine import find_matches  # noqa: E402
from torch2step.frontend.onnx_export import grouped_mm_translation_table  # noqa: E402
from torch2step.frontend.onnx_fold import fold_constants  # noqa: E402
from torch2step.frontend.onnx_graph import OnnxView  # noqa: E402
from torch2step.frontend.onnx_import import PATTERNS, import_onnx, load_onnx_model  # noqa: E402
from torch2step.layers import Linear, MoEExperts, Reshape, TopKRouting, evaluate  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def _seed_all(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter from one seeded generator (standalone HF blocks leave experts empty)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return module.eval()


class LoopMoE(nn.Module):
    """A user-written MoE: softmax router, top-k, ``for e in range(E)`` with where/index_add_."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_gate = nn.Parameter(torch.empty(EXPERTS, INTER, HIDDEN))
        self.w_up = nn.Parameter(torch.empty(EXPERTS, INTER, HIDDEN))
        self.w_down = nn.Parameter(torch.empty(EXPERTS, HIDDEN, INTER))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            tok, slot = torch.where(ids == e)
            h = x[tok]
            y = F.linear(
                F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e]
            )
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out


def _hf_block(family: str, impl: str) -> nn.Module:
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            experts_implementation=impl,
        )
        return _seed_all(MixtralSparseMoeBlock(cfg), 1)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        experts_implementation=impl,
    )
    return _seed_all(Qwen3MoeSparseMoeBlock(cfg), 2)


CASES = {
    "mixtral-batched_mm": ("mixtral", "batched_mm"),
    "qwen3-batched_mm": ("qwen3", "batched_mm"),
    "mixtral-grouped_mm": ("mixtral", "grouped_mm"),
    "qwen3-grouped_mm": ("qwen3", "grouped_mm"),
    "loop": ("user", "loop"),
}


def _export(case: str, path: str) -> nn.Module:
    family, impl = CASES[case]
    if family == "user":
        module = _seed_all(LoopMoE(), 3)
        x = torch.randn(10, HIDDEN)
        dyn = ({0: torch.export.Dim("tokens")},)
    else:
        module = _hf_block(family, impl)
        x = torch.randn(2, 5, HIDDEN)
        dyn = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
    table = grouped_mm_translation_table() if impl == "grouped_mm" else None
    prog = torch.onnx.export(
        module,
        (x,),
        dynamo=True,
        opset_version=20,
        dynamic_shapes=dyn,
        custom_translation_table=table,
        verbose=False,
    )
    prog.save(path)
    return module


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, str]]:
    out: dict[str, tuple[nn.Module, str]] = {}
    for case in CASES:
        path = str(tmp_path_factory.mktemp("moe") / f"{case}.onnx")
        out[case] = (_export(case, path), path)
    return out


def _inputs(case: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = (
        [(9, HIDDEN), (4, HIDDEN), (1, HIDDEN)]
        if case == "loop"
        else [(2, 5, HIDDEN), (3, 2, HIDDEN), (1, 1, HIDDEN)]
    )
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.mark.parametrize("case", list(CASES))
def test_moe_block_matches_pytorch(case: str, exported: dict) -> None:
    module, path = exported[case]
    graph = import_onnx(path)
    empty_seen = False
    for x in _inputs(case):
        with torch.no_grad():
            want = module(x)
            ids = torch.topk(
                F.softmax(x.reshape(-1, HIDDEN) @ _router_weight(module).T, -1), TOP_K
            ).indices
        empty_seen |= ids.unique().numel() < EXPERTS
        got = evaluate(graph, x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert empty_seen, "one input must leave some experts without tokens"


def _router_weight(module: nn.Module) -> torch.Tensor:
    return module.router.weight if isinstance(module, LoopMoE) else module.gate.weight


def _expert_weights(module: nn.Module) -> tuple[torch.Tensor, ...]:
    if isinstance(module, LoopMoE):
        return module.w_gate, module.w_up, module.w_down
    gate, up = module.experts.gate_up_proj.chunk(2, dim=1)
    return gate, up, module.experts.down_proj


@pytest.mark.parametrize("case", list(CASES))
def test_moe_block_raises_to_router_and_one_moe_experts(case: str, exported: dict) -> None:
    module, path = exported[case]
    graph = import_onnx(path)
    kinds = {type(n.op) for n in graph.nodes}
    assert kinds <= {Linear, TopKRouting, MoEExperts, Reshape}
    (router,) = [n.op for n in graph.ops(TopKRouting)]
    assert router == TopKRouting(k=TOP_K, softmax_first=True, normalize=True)
    (moe,) = list(graph.ops(MoEExperts))
    assert moe.op == MoEExperts(num_experts=EXPERTS, top_k=TOP_K, activation="silu")
    for name, want in zip(moe.inputs[3:], _expert_weights(module)):
        assert torch.equal(graph.params[name], want.detach())
    (linear,) = list(graph.ops(Linear))
    assert torch.equal(graph.params[linear.inputs[1]], _router_weight(module).detach())
    assert {str(s) for s in graph.dims} == ({"tokens"} if case == "loop" else {"batch", "seq"})


@pytest.mark.parametrize("case", list(CASES))
def test_moe_spelling_is_recognised_and_verified(case: str, exported: dict) -> None:
    _, path = exported[case]
    view = OnnxView.build(load_onnx_model(path))
    fold_constants(view)
    matches, _ = find_matches(view.node_view(), PATTERNS)
    (match,) = {id(m): m for m in matches.values() if m.pattern.startswith("moe_")}.values()
    assert match.pattern == f"moe_{CASES[case][1]}"
    assert match.info["verified"] is True


def test_a_region_that_is_not_a_weighted_sum_is_reported(exported: dict) -> None:
    """Combining expert outputs with ``max`` instead of a sum is not MoEExperts: the meaning
    check rejects it and the error lists what is left, with the reason."""
    _, path = exported["loop"]
    model = onnx.load(path)
    for node in model.graph.node:
        if node.op_type == "ScatterND":
            for a in node.attribute:
                if a.name == "reduction":
                    a.s = b"max"
    with pytest.raises(UnsupportedOperatorError) as err:
        import_onnx(model)
    msg = str(err.value)
    assert "ScatterND" in msg and "NonZero" in msg
    assert "does not compute sum_j w[t, j] * expert(x[t])" in msg


class _SinLoopMoE(LoopMoE):
    """:class:`LoopMoE` whose expert 1 puts ``sin`` (no layer op) between its projections."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            tok, slot = torch.where(ids == e)
            h, act = x[tok], (torch.sin if e == 1 else F.silu)
            y = F.linear(
                act(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e]
            )
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out


def test_out_of_scope_expert_is_named(tmp_path) -> None:
    """The per-expert diagnostic belongs to the MoE recogniser both frontends share: the ONNX
    import names the expert and what it computes, as the PyTorch frontend does."""
    path = str(tmp_path / "sin.onnx")
    dyn = ({0: torch.export.Dim("tokens")},)
    module = _seed_all(_SinLoopMoE(), 3)
    torch.onnx.export(module, (torch.randn(10, HIDDEN),), dynamo=True, opset_version=20,
                      dynamic_shapes=dyn, verbose=False).save(path)  # fmt: skip
    with pytest.raises(UnsupportedOperatorError) as err:
        import_onnx(path)
    msg = str(err.value)
    assert "experts must be down(act(gate(x)) * up(x)) or down(act(up(x)))" in msg
    assert "expert 1 computes" in msg and "Sin" in msg


def test_grouped_translation_runs_in_onnxruntime(exported: dict) -> None:
    ort = pytest.importorskip("onnxruntime")
    module, path = exported["qwen3-grouped_mm"]
    sess = ort.InferenceSession(path)
    x = _inputs("qwen3-grouped_mm")[0]
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, module(x).numpy(), atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_onnx_block_runs_and_reports(case: str, exported: dict) -> None:
    """``compile(path)``: the STeP program equals the module; a report simulates it."""
    import torch2step

    module, path = exported[case]
    inputs = _inputs(case)
    prog = torch2step.compile(path, (inputs[0],))
    for x in inputs:
        with torch.no_grad():
            want = module(x)
        torch.testing.assert_close(prog.run(x), want, atol=1e-4, rtol=0)
    assert prog.report(inputs[0]).latency_cycles > 0
