"""compile -> run equals the module for HF MoE blocks (batched_mm, grouped_mm) and a user loop
MoE; report() simulates them; routing is data, not compiled in."""

from __future__ import annotations

import pytest
import torch
from torch_blocks import EXPERTS, HIDDEN, TOP_K, LoopMoE, hf_moe, seed_all

import torch2step

CASES = {
    "mixtral-batched_mm": lambda: hf_moe("mixtral", "batched_mm"),
    "mixtral-grouped_mm": lambda: hf_moe("mixtral", "grouped_mm"),
    "qwen3-batched_mm": lambda: hf_moe("qwen3", "batched_mm"),
    "qwen3-grouped_mm": lambda: hf_moe("qwen3", "grouped_mm"),
    "loop": lambda: seed_all(LoopMoE(), 3),
}


def _inputs(case: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    shapes = (
        [(9, HIDDEN), (4, HIDDEN), (1, HIDDEN)]
        if case == "loop"
        else [(2, 5, HIDDEN), (3, 2, HIDDEN), (1, 1, HIDDEN)]
    )
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.fixture(scope="module")
def compiled() -> dict[str, tuple[torch.nn.Module, torch2step.Program]]:
    out = {}
    for case, make in CASES.items():
        module = make().eval()
        x = _inputs(case)[0]
        out[case] = (module, torch2step.compile(module, (x,), chip="step-sda"))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_run_equals_module(case: str, compiled: dict) -> None:
    module, prog = compiled[case]
    empty_experts = False
    for x in _inputs(case):
        with torch.no_grad():
            want = module(x)
        got = prog.run(x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        rep = prog.report(x)
        assert rep.latency_cycles > 0 and rep.hbm_bytes > 0
        empty_experts |= 0 in rep.dynamic["tokens_per_expert"]
    assert empty_experts, "one input must leave some experts without tokens"


def test_routing_is_data(compiled: dict) -> None:
    """One compiled program, two routings of the same tokens: different latencies."""
    _, prog = compiled["qwen3-grouped_mm"]
    x = torch.randn(4, 8, HIDDEN)
    tokens = 32
    skewed = torch.tensor([[0, 1]] * tokens)
    balanced = torch.tensor([[(2 * t) % EXPERTS, (2 * t + 1) % EXPERTS] for t in range(tokens)])
    a = prog.report(x, routing=skewed)
    b = prog.report(x, routing=balanced)
    assert a.dynamic["tokens_per_expert"][:2] == [tokens, tokens]
    assert max(b.dynamic["tokens_per_expert"]) == tokens * TOP_K // EXPERTS
    assert a.latency_cycles != b.latency_cycles
    # a skewed routing loads fewer experts' weights
    assert a.hbm_bytes < b.hbm_bytes
