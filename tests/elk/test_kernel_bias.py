"""Kernel execution of a Linear with a bias: the matrix product as an ELK matmul operator (its
weight preloaded and partitioned over cores), then the bias added to its rows."""

from __future__ import annotations

import torch
from torch import nn

import torch2step


def test_a_biased_linear_is_a_matmul_then_a_bias() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 1024)
    m = nn.Linear(1024, 2048, bias=True).eval()
    prog = torch2step.compile(m, (x,), chip="ipu-hbm", dynamic_shapes={"input": {}})
    kinds = [o.kind for o in prog.graph.ops]
    assert kinds == ["matmul", "vector"], kinds
    matmul = prog.graph.ops[0]
    assert matmul.dims == (8, 1024, 2048)
    assert prog.schedule.plans[0].cores > 1  # partitioned, not one core holding 8 MiB
    with torch.no_grad():
        assert torch.allclose(prog.run(x), m(x), atol=1e-5)
    assert prog.report().cycles > 0  # fits the cores' SRAM (it overflowed one core before)
