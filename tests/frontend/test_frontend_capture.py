"""Capture: the default dynamic dims (heuristic and names), user ``torch.export.Dim`` names,
attention kept whole, aliased example inputs, and the output structure of the raised graph."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim
from torch_blocks import HIDDEN, seed_all

from torch2step.frontend import capture, default_dynamic_axes, default_dynamic_shapes, from_torch
from torch2step.frontend.fx_view import op_name
from torch2step.layers import Attention, evaluate


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_default_axes_heuristic() -> None:
    assert default_dynamic_axes(_x(10, 64)) == {0: "T"}
    assert default_dynamic_axes(_x(3, 5, 64)) == {0: "B", 1: "S"}
    assert default_dynamic_axes(_x(3, 1, 64)) == {0: "B"}  # size-1 axes stay static
    assert default_dynamic_axes(_x(3, 2, 10, 16)) == {0: "B", 2: "L"}
    assert default_dynamic_axes(_x(3, dtype=torch.int64)) == {0: "B"}
    assert default_dynamic_axes(_x(3, 4, dtype=torch.int64)) == {0: "B", 1: "S"}
    assert default_dynamic_axes(_x(64)) == {}


def test_default_shapes_share_dims_by_name_and_size() -> None:
    x, k, v, lens = _x(3, 1, 64), _x(3, 2, 10, 16), _x(3, 2, 10, 16), _x(3, dtype=torch.int64)
    specs = default_dynamic_shapes((x, k, v, lens, 7))
    assert specs[4] is None
    assert specs[0][0] is specs[1][0] is specs[3][0]  # one batch B
    assert specs[1][2] is specs[2][2] and specs[1][2].__name__ == "L"  # one KV length L
    auto = default_dynamic_shapes((x, k), named=False)
    assert auto[1] == {0: Dim.AUTO, 2: Dim.AUTO}


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = seed_all(nn.Linear(HIDDEN, 32, bias=False), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.up(x))


def test_user_dim_names() -> None:
    graph = from_torch(_Gated(), (_x(6, HIDDEN),), dynamic_shapes=({0: Dim("tokens")},))
    assert [(str(s), src) for s, src in graph.dims.items()] == [("tokens", ("x", 0))]
    assert str(graph.types[graph.outputs[0]]) == "fp32[tokens, 32]"


class _FixedTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, 3, x.shape[-1]).sum(dim=1)


def test_heuristic_dims_the_module_fixes_become_static() -> None:
    graph = from_torch(_FixedTokens(), (_x(6, 4),))
    assert graph.dims == {}
    assert graph.types["x"].shape == (6, 4)
    torch.testing.assert_close(evaluate(graph, _x(6, 4)), _FixedTokens()(_x(6, 4)))


class _Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True), k


def test_attention_kept_whole_and_aliased_inputs_kept_apart() -> None:
    q, kv = _x(2, 4, 1, 8), _x(2, 2, 6, 8)
    ep = capture(_Sdpa(), (q, kv, kv))  # k and v are the same tensor in the example
    ops = {op_name(n) for n in ep.graph.nodes if n.op == "call_function"}
    assert "scaled_dot_product_attention" in ops and "bmm" not in ops
    graph = from_torch(_Sdpa(), (q, kv, kv))
    (node,) = graph.ops(Attention)
    assert node.inputs == ("q", "k", "v")
    assert not graph.single_output and graph.outputs[1] == "k"
    k2, v2 = _x(3, 2, 9, 8), _x(3, 2, 9, 8) + 1.0
    q2 = _x(3, 4, 1, 8)
    out, k_out = evaluate(graph, q2, k2, v2)
    torch.testing.assert_close(out, _Sdpa()(q2, k2, v2)[0])
    assert k_out is k2


def test_single_output_structure() -> None:
    graph = from_torch(_Gated(), (_x(5, HIDDEN),))
    assert graph.single_output and graph.inputs == ["x"]
    assert isinstance(evaluate(graph, _x(2, HIDDEN)), torch.Tensor)


class _FixesTokens(nn.Module):
    """Reshapes its tokens into a fixed [2, 2, H]: the default dynamic T contradicts it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(2, 2, x.shape[1]).sum(0)


def test_fallback_to_automatic_dims_is_said_and_noted() -> None:
    # a handler on the logger itself: the CLI's set-up stops "torch2step" records at its logger
    logger, records = logging.getLogger("torch2step.frontend.capture"), _Records()
    logger.addHandler(records)
    try:
        g = from_torch(_FixesTokens(), (_x(4, 8),))
    finally:
        logger.removeHandler(records)
    (rec,) = [r for r in records.records if "Dim.AUTO" in r.getMessage()]
    assert "x[0]=T" in rec.getMessage() and "pass dynamic_shapes" in rec.getMessage()
    assert len(g.notes) == 1 and "Dim.AUTO" in g.notes[0]
    # with no fallback there is no note
    assert from_torch(nn.Linear(8, 4), (_x(4, 8),)).notes == []


_SEEN: list[object] = []


class _SeesStderr(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import sys

        _SEEN.append(sys.stderr)
        return x * 2


def test_capture_leaves_stderr_and_warning_filters_alone() -> None:
    import sys
    import warnings

    before = list(warnings.filters)
    _SEEN.clear()
    capture(_SeesStderr(), (_x(4, 8),))
    assert _SEEN and all(s is sys.stderr for s in _SEEN)
    assert list(warnings.filters) == before


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
