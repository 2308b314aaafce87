"""Errors a person can act on: every unsupported operation in one error with its source line,
HF eager experts, example inputs that do not fit the module, data-dependent control flow."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_blocks import HIDDEN, hf_moe

from torch2step.errors import FrontendError, UnsupportedOperatorError
from torch2step.frontend import from_torch


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


class _TwoUnsupported(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        running = torch.cumsum(self.proj(x), dim=0)
        return torch.cos(running) + x


def test_all_unsupported_operations_in_one_error() -> None:
    with pytest.raises(UnsupportedOperatorError) as info:
        from_torch(_TwoUnsupported(), (_x(5, HIDDEN),))
    msg = str(info.value)
    assert "2 operation(s)" in msg
    lines = msg.splitlines()
    cumsum = next(line for line in lines if "aten.cumsum.default" in line)
    cos = next(line for line in lines if "aten.cos.default" in line)
    assert lines.index(cumsum) < lines.index(cos)  # graph order
    assert re.search(
        r"- cumsum: .* at .*test_frontend_errors\.py:\d+ in forward: running = torch\.cumsum",
        cumsum,
    )
    assert re.search(
        r"- cos: .* at .*test_frontend_errors\.py:\d+ in forward: return torch\.cos", cos
    )
    assert "What to do" in msg and "RULES" in msg
    assert info.value.__cause__ is None


def test_eager_experts_name_the_fix() -> None:
    with pytest.raises(FrontendError) as info:
        from_torch(hf_moe("mixtral", "eager"), (_x(2, 5, HIDDEN),))
    msg = str(info.value)
    assert not isinstance(info.value, UnsupportedOperatorError)
    for word in ("eager", "batched_mm", "grouped_mm", "experts_implementation", "data-dependent"):
        assert word in msg
    assert "modeling_mixtral.py" in msg  # the line that stopped export
    assert info.value.__cause__ is None and info.value.__suppress_context__


class _Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(x))


def test_wrong_feature_size_names_the_linear() -> None:
    with pytest.raises(FrontendError) as info:
        from_torch(_Proj(), (_x(5, 32),))
    msg = str(info.value)
    assert "proj (nn.Linear, weight [8, 64]" in msg and "expects inputs [..., 64]" in msg
    assert "[5, 32] float32" in msg
    assert "test_frontend_errors.py" in msg and "self.proj(x)" in msg


def test_wrong_dtype_is_explained() -> None:
    with pytest.raises(
        FrontendError, match=r"example input .x. is float64 but the parameters of _Proj are float32"
    ):
        from_torch(_Proj(), (_x(5, HIDDEN).double(),))


def test_hf_block_hidden_size_checked_before_export() -> None:
    with pytest.raises(FrontendError, match=r"hidden_size = 64.*got \[2, 5, 32\]"):
        from_torch(hf_moe("qwen3", "batched_mm"), (_x(2, 5, 32),))


def test_wrong_number_of_inputs() -> None:
    with pytest.raises(FrontendError, match="does not take 2 positional example inputs"):
        from_torch(_Proj(), (_x(5, HIDDEN), _x(5, HIDDEN)))


def test_cache_objects_are_refused() -> None:
    class Cache:
        pass

    with pytest.raises(FrontendError, match="tensor-in/tensor-out"):
        from_torch(_Proj(), (Cache(),))


class _Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 0).sum() > 3:
            return x * 2
        return x


def test_data_dependent_branch_points_to_the_line() -> None:
    with pytest.raises(FrontendError) as info:
        from_torch(_Branchy(), (_x(4, 8),))
    msg = str(info.value)
    assert "torch.cond" in msg and "if (x > 0).sum() > 3" in msg


class _MaskInput(nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_unrecognised_mask_is_explained() -> None:
    q, k, v = _x(2, 4, 3, 8), _x(2, 4, 5, 8), _x(2, 4, 5, 8)
    with pytest.raises(UnsupportedOperatorError, match="kv_lengths"):
        from_torch(_MaskInput(), (q, k, v, torch.ones(2, 1, 3, 5, dtype=torch.bool)))
