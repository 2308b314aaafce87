"""Shared instructions (``ProgramBuilder(share=True)``) and the recording builder of the ELK
activation flow: the programs, and what the simulator makes of them, are those of the plain
builder."""

from __future__ import annotations

import pytest

from elk.ops import Operator
from elk.plan import plan_model
from hwmodel.presets import load_chip
from lowering.builder import ProgramBuilder, RecordingBuilder
from lowering.errors import ProgramError
from lowering.isa import ProgramSet
from runtime import simulate
from torch2step.kernel.build import bind_timing, timing_links


def _tile_program(share: bool) -> ProgramSet:
    b = ProgramBuilder("tiles", share=share)
    b.tensor("X", (4, 8), "fp32")
    b.channel("c", 0, [1, 2])
    for core in (0, 1, 2):
        p = b.core(core)
        p.alloc("t", (4, 8), "fp32")
        if core == 0:
            p.load("t", "X")
            p.send("c", "t")
        else:
            p.recv("c", "t")
        p.alloc("u", [4, 8], "fp32")
        p.compute("add", "u", ("t", "t"), dtype="fp32")
        p.free("t")
        p.free("u")
    return b.build()


def test_shared_instructions_are_equal_programs_with_one_object_per_value() -> None:
    plain, shared = _tile_program(False), _tile_program(True)
    assert plain == shared
    allocs = [ins for p in shared.programs for ins in p.body if type(ins).__name__ == "Alloc"]
    assert len(allocs) == 6 and len({id(a) for a in allocs}) == 2
    assert shared.programs[1].body[1] is shared.programs[2].body[1]  # the Recv
    unshared = [ins for p in plain.programs for ins in p.body if type(ins).__name__ == "Alloc"]
    assert len({id(a) for a in unshared}) == 6


def test_shared_instructions_simulate_the_same() -> None:
    chip = load_chip("ipu-hbm")
    a, b = simulate(_tile_program(False), chip), simulate(_tile_program(True), chip)
    assert a.cycles == b.cycles > 0
    assert a.stats.to_dict() == b.stats.to_dict()


def test_recording_builder_keeps_channel_names_only() -> None:
    b = RecordingBuilder("rec")
    assert b.tensor("X", (2, 2)) == "X"
    assert not b.has_channel("c")
    b.channel("c", 0, 1)
    assert b.has_channel("c")
    p = b.core(0)
    assert p.alloc("t", (2, 2)).load("t", "X").send("c", "t").free("t") is p
    assert p.body() == ()
    with pytest.raises(ProgramError, match="keeps no instructions"):
        b.build()


def test_elk_programs_share_tile_instructions_across_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A matmul tiled over many cores: the tiles' equal instructions are one object and the
    program set equals one built without sharing."""
    from lowering import elk_programs as ep

    chip = load_chip("ipu-hbm")
    ops = [
        Operator("proj", "matmul", (32, 1024, 1024), slot=0),
        Operator("act", "vector", (32, 1024), slot=1, flops_per_elem=5),
    ]
    s = plan_model(ops, chip)
    bound, tensors = bind_timing(s.ops, s.plans)
    links = timing_links(bound, tensors)
    ps = ep.elk_programs(chip, bound, s.plans, s.order, s.issued, tensors, links=links)
    frees = [ins for p in ps.programs for ins in p.body if type(ins).__name__ == "Free"]
    assert len(frees) > len({id(f) for f in frees})
    plain = ep.ProgramBuilder

    class Unshared(plain):  # type: ignore[misc,valid-type]
        def __init__(self, name: str = "program", *, share: bool = False) -> None:
            super().__init__(name, share=False)

    monkeypatch.setattr(ep, "ProgramBuilder", Unshared)
    ref = ep.elk_programs(chip, bound, s.plans, s.order, s.issued, tensors, links=links)
    assert ps == ref
    assert simulate(ps, chip).cycles == simulate(ref, chip).cycles
