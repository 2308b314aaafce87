"""HBM channel classes (runtime.hbm_classes): merging the classes a request leaves free at one
cycle changes no cycle and no statistic.  A traced run never merges classes, so it is the
reference the untraced run is compared with (ELK §5: each channel first come first served)."""

from __future__ import annotations

import pytest
from runtime_testkit import a2a_chip, hbm

from lowering.isa import Alloc, Load, Program, ProgramSet, Region, TensorDecl
from runtime import SimResult, Simulator


def _channels(r: SimResult) -> list[tuple]:
    return [(h.busy, h.bytes, h.transfers) for h in r.stats.hbm_channels]


def test_merged_classes_keep_each_channels_busy_cycles() -> None:
    """A load on channel 0 alone, then two loads over all four channels that end together on
    every channel (channel 0 busy 4 cycles longer: the merged class keeps two busy values),
    then a load on channel 1 alone, which splits the merged class again."""
    loads = (((0,), (16,)), ((256,), (128,)), ((512,), (128,)), ((32,), (16,)))
    prog = Program(0, (Alloc("a", (128,)),) + tuple(Load("a", "w", Region(*r)) for r in loads))
    ps = ProgramSet((prog,), tensors=(TensorDecl("w", (4096,)),))
    chip = a2a_chip(2, mem=hbm(channels=4))
    merged = Simulator(ps, chip).run()
    ref = Simulator(ps, chip).run(trace=True)
    assert merged.cycles == ref.cycles
    assert _channels(merged) == _channels(ref) == [(68, 160, 3), (68, 160, 3)] + [(64, 128, 2)] * 2
    # the two loads over merged classes were each one class grant, not two
    assert merged.stats.events.closed_form_grants == ref.stats.events.closed_form_grants + 1


@pytest.mark.parametrize("cores", [2, 4])
def test_mixed_loads_give_the_per_channel_statistics(cores: int) -> None:
    """Unaligned, partial and whole-stripe loads from several cores: the same cycles and
    per-channel busy cycles, bytes and transfers as the traced (unmerged) run."""
    progs = []
    for c in range(cores):
        regions = [(c * 40 + 20, 100), (c * 96, 48), (4096 + c * 128, 128)]
        regions += [(8192 + c * 512, 512), (16384 + c * 256, 256), (c * 8 + 3, 24)]
        body = (Alloc("t", (512,)),) + tuple(Load("t", "w", Region((o,), (n,))) for o, n in regions)
        progs.append(Program(c, body))
    ps = ProgramSet(tuple(progs), tensors=(TensorDecl("w", (32768,)),))
    chip = a2a_chip(cores, mem=hbm(channels=4))
    merged = Simulator(ps, chip).run()
    ref = Simulator(ps, chip).run(trace=True)
    assert merged.cycles == ref.cycles
    assert _channels(merged) == _channels(ref)
    assert [c.finish for c in merged.stats.cores] == [c.finish for c in ref.stats.cores]


def test_a_request_over_many_classes_merges_those_free_together() -> None:
    """Eight channels: core 0's first loads give five channels different states (six classes),
    core 1 keeps channel 0 busy, so a whole-stripe load over the six classes leaves channel 0
    free later than the other seven: those seven merge (with different busy cycles), channel 0
    stays apart.  Everything as in the traced (unmerged) run."""
    first = [((0,), (32,)), ((32,), (16,)), ((64,), (8,)), ((96,), (32,)), ((128,), (24,))]
    stripes = [((512 * i,), (256,)) for i in range(1, 4)]
    body = tuple(Load("a", "w", Region(*r)) for r in first + stripes + [((96,), (16,))])
    p0 = Program(0, (Alloc("a", (256,)),) + body)
    ch0 = tuple(Load("b", "w", Region((2048 + 256 * i,), (32,))) for i in range(6))
    p1 = Program(1, (Alloc("b", (32,)),) + ch0)
    ps = ProgramSet((p0, p1), tensors=(TensorDecl("w", (4096,)),))
    chip = a2a_chip(2, mem=hbm(channels=8, bw=4.0))
    merged = Simulator(ps, chip).run()
    ref = Simulator(ps, chip).run(trace=True)
    assert merged.cycles == ref.cycles
    assert _channels(merged) == _channels(ref)
    assert [c.finish for c in merged.stats.cores] == [c.finish for c in ref.stats.cores]
    assert merged.stats.events.closed_form_grants > ref.stats.events.closed_form_grants


@pytest.mark.parametrize("cores", [2, 3])
def test_alternating_splits_give_the_per_channel_statistics(cores: int) -> None:
    """Two request shapes taking turns, each as several loads of equal regions (equal splits,
    one plan): an unaligned load that refines the classes and whole-stripe loads that merge
    them again; a plan over classes a change did not touch is kept.  The same cycles and
    per-channel statistics as the traced (unmerged) run."""
    progs = []
    for c in range(cores):
        body: list = [Alloc("t", (512,))]
        for i in range(4):
            body += [Load("t", "w", Region((c * 24 + 8,), (40,)))] * 2
            body += [Load("t", "w", Region((2048 * (c + 1),), (256,)))] * 2
            body += [Load("t", "w", Region((8192 + 64 * i,), (64,)))]
        progs.append(Program(c, tuple(body)))
    ps = ProgramSet(tuple(progs), tensors=(TensorDecl("w", (16384,)),))
    chip = a2a_chip(cores, mem=hbm(channels=8))
    merged = Simulator(ps, chip).run()
    ref = Simulator(ps, chip).run(trace=True)
    assert merged.cycles == ref.cycles
    assert _channels(merged) == _channels(ref)
    assert [c.finish for c in merged.stats.cores] == [c.finish for c in ref.stats.cores]
