"""Raising by meaning, not spelling: property tests drawing spellings of a loop MoE and of
RoPE positions and checking each raises to the same layer graph (and equals the module).

Each example is a ``torch.export`` capture (seconds on a small machine): the example counts are
small and the canonical graphs are cached; ``derandomize`` keeps the drawn spellings fixed."""

from __future__ import annotations

import functools

import pytest
import torch
import torch_blocks as tb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_spellings import ACCUMULATE, ACTIVATION, FIND, GATHER, HIDDEN, SpelledMoE, Spelling
from torch import nn

from torch2step.errors import UnsupportedOperatorError
from torch2step.frontend import capture, raise_program
from torch2step.frontend.capture import dim_names
from torch2step.layers import LayerGraph, MoEExperts, evaluate

_SETTINGS = settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _raise(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> LayerGraph:
    ep = capture(module, inputs)
    return raise_program(ep, name="m", dim_names=dim_names(module, inputs))


def _structure(g: LayerGraph) -> tuple:
    """The graph up to value and parameter names: ops in order, and parameter shapes."""
    ops = tuple(n.op for n in g.nodes)
    params = tuple(sorted(tuple(t.shape) for t in g.params.values()))
    return ops, params, tuple(tuple(g.types[i].shape) for i in g.inputs)


# -- MoE ----------------------------------------------------------------------------------------
_X = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(5))


@functools.cache
def _canonical(activation: str, gated: bool, bias: bool) -> LayerGraph:
    s = Spelling(activation=activation, gated=gated, bias=bias)
    return _raise(SpelledMoE(s).eval(), (_X,))


spellings = st.builds(
    Spelling,
    find=st.sampled_from(FIND),
    gather=st.sampled_from(GATHER),
    accumulate=st.sampled_from(ACCUMULATE),
    activation=st.sampled_from(ACTIVATION),
    gated=st.booleans(),
    bias=st.booleans(),
    modules=st.booleans(),
)


@_SETTINGS
@given(spellings)
def test_moe_spellings_raise_to_the_same_graph(s: Spelling) -> None:
    moe = SpelledMoE(s).eval()
    graph = _raise(moe, (_X,))
    ref = _canonical(s.activation, s.gated, s.bias)
    assert [type(n.op).__name__ for n in graph.nodes] == ["Linear", "TopKRouting", "MoEExperts"]
    assert _structure(graph) == _structure(ref)
    (node,) = graph.ops(MoEExperts)
    assert node.op == MoEExperts(4, 2, s.activation, gated=s.gated, bias=s.bias)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = moe(x)
    torch.testing.assert_close(evaluate(graph, x), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(evaluate(ref, x), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("find", FIND)
def test_every_token_finder_raises(find: str) -> None:
    s = Spelling(find=find, gather="index_select")
    graph = _raise(SpelledMoE(s).eval(), (_X,))
    assert _structure(graph) == _structure(_canonical("silu", True, False))


class _TanhExperts(SpelledMoE):
    """Experts whose MLP the layer graph has no op for (tanh between the projections)."""

    def expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        return self._proj(
            "down", e, torch.tanh(self._proj("gate", e, xs)) * self._proj("up", e, xs)
        )


def test_out_of_scope_expert_is_named() -> None:
    with pytest.raises(UnsupportedOperatorError) as info:
        _raise(_TanhExperts(Spelling(find="any_where", gather="index_select")).eval(), (_X,))
    msg = str(info.value)
    assert "experts must be down(act(gate(x)) * up(x)) or down(act(up(x)))" in msg
    assert "expert 0 computes" in msg and "tanh" in msg
    assert "index_select" in msg  # the op the user wrote is named, with what it is supported in


def test_plain_and_biased_experts_say_they_do_not_lower_yet() -> None:
    import torch2step

    moe = SpelledMoE(Spelling(gated=False, bias=True, activation="gelu")).eval()
    with pytest.raises(torch2step.Torch2StepError, match="plain two-matrix MLP and biases"):
        torch2step.compile(moe, (_X,), chip="step-sda")


# -- RoPE positions -----------------------------------------------------------------------------
POSITIONS = {
    "arange": lambda b, p: torch.arange(p, p + 1).expand(b, 1),
    "arange_plus": lambda b, p: (torch.arange(1) + p).expand(b, 1),
    "full": lambda b, p: torch.full((b, 1), p),
    "zeros_plus": lambda b, p: torch.zeros(b, 1, dtype=torch.long) + p,
    "ones_mul": lambda b, p: torch.ones(b, 1, dtype=torch.long) * p,
    "tail_of_arange": lambda b, p: torch.arange(p + 1)[-1:].expand(b, 1),
    "new_full": lambda b, p: torch.zeros(1, dtype=torch.long).new_full((b, 1), p),
    "sub_of_next": lambda b, p: torch.full((b, 1), p + 1) - 1,
}


class _Positions(tb.DecodeStep):
    """:class:`torch_blocks.DecodeStep` (sdpa, no KV-length input) with the positions spelled
    ``how``."""

    def __init__(self, family: str, how: str) -> None:
        super().__init__(family, "sdpa")
        self.how = how

    def forward(self, x, past_k, past_v):  # type: ignore[override]
        a = self.attn
        b, past = x.shape[0], past_k.shape[2]
        cos, sin = self.rope(x, POSITIONS[self.how](b, past))
        shape = (*x.shape[:-1], -1, a.head_dim)
        q, k = a.q_proj(x).view(shape), a.k_proj(x).view(shape)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = tb.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(shape).transpose(1, 2)
        nk, nv = torch.cat([past_k, k], -2), torch.cat([past_v, v], -2)
        o = nn.functional.scaled_dot_product_attention(q, nk, nv, enable_gqa=True)
        return a.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1)), nk, nv


@functools.cache
def _canonical_positions(family: str) -> LayerGraph:
    return _raise(_Positions(family, "arange").eval(), tb.decode_inputs(3, 5, 0))


@_SETTINGS
@given(st.sampled_from(sorted(POSITIONS)), st.sampled_from(["llama", "qwen3"]))
def test_position_spellings_raise_to_the_same_graph(how: str, family: str) -> None:
    step = _Positions(family, how).eval()
    graph = _raise(step, tb.decode_inputs(3, 5, 0))
    assert _structure(graph) == _structure(_canonical_positions(family))
    ins = tb.decode_inputs(2, 9, 1)
    with torch.no_grad():
        want = step(*ins)
    for got, ref in zip(evaluate(graph, *ins), want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_position_spellings_run_equal_to_pytorch() -> None:
    import torch2step

    step = _Positions("llama", "full").eval()
    prog = torch2step.compile(step, tb.decode_inputs(3, 5, 0), chip="step-sda")
    ins = tb.decode_inputs(2, 4, 2)
    with torch.no_grad():
        want = step(*ins)
    for got, ref in zip(prog.run(*ins), want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
