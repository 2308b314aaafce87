"""The order of each core's preload pieces (:mod:`lowering.elk_pieces`): an attention's KV
pieces rotated where that balances the HBM channels, faster in simulation where it rotates, and computed on in that
order with the same results as PyTorch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kernel_helpers import assert_kernel_run_equals, preload_alone_cycles

import lowering.elk_programs as elk_programs_mod
import torch2step
from elk.cost import ChipCosts, item_for
from elk.ops import decode_step_ops
from hwmodel.chip import Chip
from hwmodel.presets import load_chip
from lowering.elk_pieces import _balance, piece_order, piece_runs, rotates
from lowering.elk_placement import place
from models.registry import get_layer
from torch2step.kernel.build import bind_timing
from torch2step.kernel.program import KernelProgram


def _x4() -> Chip:
    """ELK §6.1's four chips as one all-to-all chip (as ``benchmarks/elk_figures.py``)."""
    base = load_chip("ipu-hbm")
    hbm = dataclasses.replace(base.hbm, channels=4 * base.hbm.channels)
    return dataclasses.replace(base, name="x4", num_cores=4 * base.num_cores, hbm=hbm)


def _placed(chip: Chip, name: str, tiles: tuple[int, ...]):  # noqa: ANN202
    costs = ChipCosts.from_chip(chip)
    op = next(o for o in decode_step_ops("llama3-8b", 32, 2048, 1) if o.name.endswith(name))
    it = item_for(costs, op)
    plan = next(o.ref for o in it.execs if o.ref.tiles == tiles)
    ops, tensors = bind_timing([op], [plan])
    return place(chip, ops, [plan])[0], it, ops, tensors, plan


@pytest.mark.parametrize(
    ("chip", "name", "tiles", "want"),
    [
        ("x4", "attention", (32, 8, 16), True),  # piece s of every core on the same channels
        ("x4", "gate", (1, 16, 256), False),  # products keep their activation's order
        ("x4", "qkv_proj", (1, 32, 128), False),
        ("ipu-hbm", "gate", (1, 16, 64), False),
        ("ipu-hbm", "attention", (32, 8, 4), False),  # a tie keeps the identity
    ],
)
def test_rotation_follows_channel_balance(
    chip: str, name: str, tiles: tuple[int, ...], want: bool
) -> None:
    c = _x4() if chip == "x4" else load_chip(chip)
    pl = _placed(c, name, tiles)[0]
    assert rotates(c.hbm, pl) is want
    if want:
        assert _balance(c.hbm, pl, True) < _balance(c.hbm, pl, False)
    order = piece_order(pl, 1, 2, want)
    assert sorted(order) == list(range(len(order)))
    assert order[0] == ((pl.cols + 2) % len(order) if want else 0)


def test_piece_runs_are_the_preloaded_regions() -> None:
    """The byte offsets the balance is computed from are those of the preload's regions."""
    chip = load_chip("ipu-hbm")
    pl, _, _, tensors, plan = _placed(chip, "attention", (32, 8, 4))
    b, hkv, length, d = tensors[pl.op.tensor("kc")][0]
    starts, run = piece_runs(pl, np.array([5, 6]), 3)
    for t, row in zip((5, 6), starts):
        r, c = divmod(t, pl.cols)
        ib, ig = divmod(r, plan.tiles[1])
        lb = length // plan.tiles[2]
        first = ((ib * hkv + ig) * length + c * lb + 3 * (lb // 8)) * d * 2
        assert row[0] == first and run == lb // 8 * d * 2


def test_rotated_attention_preload_is_faster_in_simulation() -> None:
    """On the four-chip set-up the KV preload of a 4096-core attention grid, issued in turn by
    every core, leaves half the channels idle; rotated it is within 20% of the cost model's
    preload time (which assumes balanced channels)."""

    chip = _x4()
    pl, it, ops, tensors, plan = _placed(chip, "attention", (32, 8, 16))
    e = next(k for k, o in enumerate(it.execs) if o.ref == plan)
    cycles = preload_alone_cycles(chip, ops, plan, tensors)
    assert abs(it.load_time(e) / cycles - 1) < 0.20


def test_rotated_pieces_compute_the_same_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every product and attention taking its pieces rotated: the decoder layer still equals
    PyTorch."""
    monkeypatch.setattr(elk_programs_mod, "rotates", lambda spec, pl: pl.op.kind != "vector")
    m, inp, ds, _ = get_layer("llama-decoder", tiny=True, batch=4)
    prog = torch2step.compile(m, inp, chip="ipu-hbm", dynamic_shapes=ds)
    assert isinstance(prog, KernelProgram)
    assert_kernel_run_equals(m, inp, prog)
