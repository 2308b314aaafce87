"""A piece of an activation that several cores read (one token block multiplied by the weight
blocks of many experts) is cut out of its buffer once and sent to each of them
(:meth:`lowering.elk_flow.Flow.put`), not cut again for every destination; the program still
equals PyTorch."""

from __future__ import annotations

import pytest
import torch

import torch2step
from lowering.isa import Compute, Free, Send
from models.registry import get_layer


@pytest.mark.parametrize("chip", ["ipu-hbm", "mesh"])
def test_a_piece_for_several_cores_is_cut_once(chip) -> None:
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(spec.module, spec.example_inputs, chip=chip)
    multi = 0
    for p in prog.programs.programs:
        last = None  # the previous cut: (buffer cut from, its parameters), until it is freed
        sends = 0
        for ins in p.body:
            if (
                isinstance(ins, Compute)
                and ins.kernel == "elk_slice"
                and ins.outs[0].endswith("_cut")
            ):
                here = (ins.ins, ins.params)
                assert here != last, f"core {p.core} cuts {here} again right after sending it"
                last, sends = here, 0
            elif isinstance(ins, Send) and last is not None:
                sends += 1
            elif isinstance(ins, Free) and ins.buf.endswith("_cut"):
                multi += sends > 1
            elif isinstance(ins, Compute) and last is not None and last[0][0] in ins.outs:
                last = None  # the buffer changed: a later cut of it is a new piece
    assert multi, "no piece went to several cores: the case is not exercised"
    got = prog.run(*spec.example_inputs)
    torch.testing.assert_close(got, spec.module(*spec.example_inputs), atol=1e-5, rtol=0)
