"""Shared by the ELK cost-model tests: an operator's preload simulated on its own."""

from __future__ import annotations

from typing import Any

import torch

from lowering.builder import ProgramBuilder
from lowering.elk_pieces import piece_order, rotates
from lowering.elk_placement import place
from lowering.elk_programs import _preload
from runtime import simulate


def preload_alone_cycles(
    chip: Any, ops: list, plan: Any, tensors: dict, in_turn: bool = False
) -> int:
    """Cycles of the preload of ``ops[0]`` under ``plan``, on the cores placement gives it,
    when every core of its grid loads its share at once (``in_turn``: as the controller's go
    token reaches it, as every preload but those issued before the first execute), in the
    programs' piece order, and nothing else runs (ELK §4.5 ``preload_async``)."""
    pl = place(chip, ops, [plan])[0]
    b = ProgramBuilder("preload")
    for t, (shape, dt) in tensors.items():
        b.tensor(t, shape, dt)
    rot = rotates(chip.hbm, pl)
    if in_turn:
        ctrl = chip.num_cores - 1
        b.channel("go1", ctrl, sorted(pl.cores))
        b.core(ctrl).send_value("go1", 1)
    for r in range(pl.rows):
        for c in range(pl.cols):
            p = b.core(pl.core(r, c))
            if in_turn:
                p.recv_value("go1", "go")
            _preload(p, 0, pl, r, c, "bf16", piece_order(pl, r, c, rot))
    return simulate(b.build(), chip).cycles


def assert_kernel_run_equals(m: Any, inp: tuple, prog: Any) -> None:
    """A compiled kernel-by-kernel program's functional run equals the module's output."""
    got = prog.run()
    with torch.no_grad():
        ref = m(*inp)
    if isinstance(ref, torch.Tensor):
        got, ref = (got,), (ref,)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
