"""Every kernel program owns the layer-graph node kernels its per-core programs evaluate
(``layer_node``, :func:`lowering.elk_kernels.register_node`): compiling or running another
program, of a module with the same class name, leaves its results as they were."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

import torch2step
from lowering.elk_kernels import NODE_KERNELS, NodeKey, register_node
from torch2step.kernel.program import KernelProgram


class M(nn.Module):
    """One class name, different sizes: its layer graphs share graph and node names."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Linear(64, n, bias=False)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.a(x))


def _node_keys(prog: KernelProgram) -> list[str]:
    return [str(o.node) for o in prog.schedule.ops if o.node is not None]


def _close(prog: KernelProgram, m: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(prog.run(x), m(x), rtol=1e-4, atol=1e-4)


def test_compiling_a_module_of_the_same_name_leaves_a_program_as_it_was() -> None:
    torch.manual_seed(0)
    m1, x1 = M(64), torch.randn(8, 64)
    p1 = torch2step.compile(m1, (x1,), chip="ipu-hbm")
    assert isinstance(p1, KernelProgram)
    alone = p1.report().cycles
    m2, x2 = M(256), torch.randn(64, 64)
    p2 = torch2step.compile(m2, (x2,), chip="ipu-hbm")
    assert not set(_node_keys(p1)) & set(_node_keys(p2))  # each program's own kernels
    assert p1.report().cycles == alone  # (was: p2's node shapes, a SimulationError)
    _close(p1, m1, x1)
    _close(p2, m2, x2)
    p2_cycles = p2.report().cycles
    # a run refused for other sizes registers nothing that changes a later report
    with pytest.raises(torch2step.Torch2StepError, match="compiled for shape"):
        p1.run(x2)
    assert p1.report().cycles == alone and p2.report().cycles == p2_cycles
    _close(p1, m1, torch.randn(8, 64))  # a run with other values, same sizes
    assert p1.report().cycles == alone and p2.report().cycles == p2_cycles


def test_the_same_module_compiled_twice_gives_the_same_cycles_and_own_kernels() -> None:
    torch.manual_seed(1)
    m, x = M(64), torch.randn(8, 64)
    p1 = torch2step.compile(m, (x,), chip="ipu-hbm")
    p2 = torch2step.compile(m, (x,), chip="ipu-hbm")
    assert not set(_node_keys(p1)) & set(_node_keys(p2))
    assert p1.report().cycles == p2.report().cycles


def test_a_programs_kernels_stay_while_it_lives_and_go_with_it() -> None:
    torch.manual_seed(2)
    m, x = M(64), torch.randn(8, 64)
    prog = torch2step.compile(m, (x,), chip="ipu-hbm")
    keys = _node_keys(prog)
    assert keys and all(k in NODE_KERNELS for k in keys)
    prog.run()
    prog.report()
    gc.collect()
    assert all(k in NODE_KERNELS for k in keys)  # held by the program's operators
    del prog
    gc.collect()
    assert not any(k in NODE_KERNELS for k in keys)


def test_register_node_makes_each_key_unique_and_the_key_holds_its_kernel() -> None:
    def fn(xs):  # type: ignore[no-untyped-def]
        return (xs[0],)

    a = register_node("G:n1", ((2, 3),), fn)
    b = register_node("G:n1", ((4, 3),), fn)
    assert isinstance(a, NodeKey) and a != b and a.startswith("G:n1#")
    assert NODE_KERNELS[a].out_shapes == ((2, 3),) and NODE_KERNELS[b].out_shapes == ((4, 3),)
    assert copy.copy(a) is a and copy.deepcopy(a) is a
    plain = pickle.loads(pickle.dumps(a))  # a plain string: looked up in the registry
    assert type(plain) is str and plain == a and NODE_KERNELS[plain] is a.kernel
    key = str(b)
    del b
    gc.collect()
    assert key not in NODE_KERNELS and a in NODE_KERNELS
