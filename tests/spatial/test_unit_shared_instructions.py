"""A unit's repeated element steps share their instruction objects (``UnitBuilder.make``) and
their step tuples; the program folded from them is the one folded from value-equal copies."""

from __future__ import annotations

from hwmodel import load_chip
from lowering.isa import Compute, Instr, Load, Loop
from torch2step.spatial.compress import compress
from torch2step.spatial.streams import Part
from torch2step.spatial.timing import TimingModel
from torch2step.spatial.unit import UnitBuilder


def _builder() -> UnitBuilder:
    return UnitBuilder("u", TimingModel(load_chip("step-sda")), lambda ch: False, lambda ch: True)


def _run(b: UnitBuilder, elements: int) -> None:
    """A DMA-like unit: per element, load the next 64-element row and one step on it."""
    out = Part("data", "bf16", 64)
    for k in range(elements):
        tile = b.load("w", (64 * k,), (64,), "bf16", rotation=2)
        b.compute(5, (tile,), (out,))
        b.step()


def _copy(x: Instr) -> Instr:
    """A value-equal instruction that is another object (nested loops copied too)."""
    if isinstance(x, Loop):
        return Loop(x.count, tuple(_copy(i) for i in x.body), x.var)
    return type(x)(*(getattr(x, f) for f in x.__dataclass_fields__))  # type: ignore[attr-defined]


def _unfold(body: tuple[Instr, ...]) -> list[Instr]:
    out: list[Instr] = []
    for ins in body:
        if isinstance(ins, Loop):
            assert isinstance(ins.count, int)
            out.extend(_unfold(ins.body) * ins.count)
        else:
            out.append(ins)
    return out


def test_equal_instructions_are_one_object() -> None:
    b = _builder()
    _run(b, 6)
    b.step()
    steps = b.steps
    # the address register advances by 64 from the second element on: steps 1.. repeat
    # with period 2 (the two rotating buffers), and the repeats are the same tuples
    assert steps[1] is steps[3] is steps[5] and steps[2] is steps[4]
    assert steps[1] != steps[2]
    computes = [x for s in steps for x in s if isinstance(x, Compute)]
    assert computes[1] is computes[3] and computes[0] is not computes[1]
    loads = [x for s in steps for x in s if isinstance(x, Load)]
    assert loads[2] is loads[4] and loads[2] == loads[0] and loads[2] is not loads[1]


def test_folded_program_is_the_one_of_value_equal_copies() -> None:
    b = _builder()
    _run(b, 9)
    b.step()
    shared = compress(b.steps)
    copied = compress([tuple(_copy(x) for x in s) for s in b.steps])
    assert shared == copied
    assert any(isinstance(x, Loop) for x in shared)
    assert _unfold(shared) == [x for s in b.steps for x in s]
