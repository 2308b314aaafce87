"""The register lowering of ``selector_index`` (STeP arXiv 2511.07776 §5.3,
torch2step.spatial.region_values): a region computes the expert id from its EagerMerge's one-hot
selector with a binary search of control instructions.  A merge over more than 64 inputs (the
128 experts of Qwen3-30B-A3B) sends masks wider than 64 bits, which a six-step search decoded to
a wrong expert (the full-size decoder's dispatch lanes then deadlocked)."""

from __future__ import annotations

import operator
from typing import Any

import pytest

from lowering.isa import CALC_FNS, Affine, Calc, If, Set
from torch2step.spatial import region_values

_CMP = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
        ">": operator.gt, ">=": operator.ge}


class _Recorder:
    """Records the control instructions the lowering emits (the builder's ``emit``)."""

    def __init__(self) -> None:
        self.instrs: list[Any] = []

    def emit(self, *instrs: Any) -> None:
        self.instrs.extend(instrs)


def _val(x: Any, regs: dict[str, int]) -> int:
    if isinstance(x, Affine):
        return x.eval(regs)
    return regs[x] if isinstance(x, str) else x


def _run(instrs: Any, regs: dict[str, int]) -> None:
    for i in instrs:
        if isinstance(i, Set):
            regs[i.reg] = _val(i.value, regs)
        elif isinstance(i, Calc):
            regs[i.reg] = CALC_FNS[i.op](_val(i.lhs, regs), _val(i.rhs, regs))
        elif isinstance(i, If):
            c = i.cond
            ok = _CMP[c.op](_val(c.lhs, regs), _val(c.rhs, regs))
            _run(i.then if ok else i.orelse, regs)
        else:  # pragma: no cover - the lowering emits only control instructions
            raise AssertionError(i)


class _ValuePart:
    kind = "value"


@pytest.mark.parametrize("index", [0, 1, 7, 63, 64, 65, 100, 127, 511, 1023])
def test_selector_index_decodes_wide_masks(index: int) -> None:
    b = _Recorder()
    elem = ((_ValuePart(), "sel"),)
    out = region_values._selector_index(b, None, elem, None)  # type: ignore[arg-type]
    assert out is not None
    regs = {"sel": 1 << index}
    _run(b.instrs, regs)
    assert regs[out] == index


def test_a_selector_wider_than_the_search_is_a_type_error() -> None:
    """A merge over more inputs than the register search decodes is refused when the graph is
    built, naming the limit, instead of decoding wrong expert ids at run time."""
    import pytest

    from torch2step.errors import StepTypeError
    from torch2step.lower.blocks.moe_lanes import MAX_SELECTOR_INPUTS, _sel_index_rule
    from torch2step.step.types import SelectorType

    _sel_index_rule("selector_index", (SelectorType(MAX_SELECTOR_INPUTS, 1),))
    with pytest.raises(StepTypeError, match="wider than"):
        _sel_index_rule("selector_index", (SelectorType(MAX_SELECTOR_INPUTS + 1, 1),))
