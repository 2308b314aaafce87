"""A body with copied layer sections kept as references (lowering.elk_copies, ELK §4.4 equal
layers) reads as the tuple of its instructions: length, items, slices, equality, hash, repr and
pickling, each copy renamed by the given copier on read."""

from __future__ import annotations

import pickle

import pytest

from lowering.elk_copies import LayeredBody
from lowering.isa import Alloc, Free


def _shift(d: int, instrs):
    out = []
    for x in instrs:
        j, rest = x.buf[1:].split("_", 1)
        out.append(
            Alloc(f"o{int(j) + d}_{rest}", x.shape)
            if isinstance(x, Alloc)
            else Free(f"o{int(j) + d}_{rest}")
        )
    return out


def test_layered_body_reads_as_its_tuple() -> None:
    real = (Alloc("o0_x", (1,)), Alloc("o1_a", (2,)), Free("o1_a"), Free("o0_x"), Free("o9_z"))
    # after position 3 of real: a copy of real[1:3] shifted by 2, then one shifted by 4
    body = LayeredBody(real, [(3, 2, 1, 2), (3, 2, 1, 4), (5, 1, 3, 5)], _shift)
    full = (
        *real[:3],
        Alloc("o3_a", (2,)),
        Free("o3_a"),
        Alloc("o5_a", (2,)),
        Free("o5_a"),
        *real[3:],
        Free("o5_x"),
    )
    assert len(body) == len(full) == 10
    assert tuple(body) == full and body == full and full == body
    assert [body[i] for i in range(-10, 10)] == [full[i] for i in range(-10, 10)]
    for lo in range(11):
        for hi in range(lo, 11):
            assert body[lo:hi] == full[lo:hi]
    assert body[::2] == full[::2]
    assert hash(body) == hash(full) and repr(body) == repr(full)
    assert pickle.loads(pickle.dumps(body)) == full
    assert body != full[:-1] and body != list(full)
    with pytest.raises(IndexError):
        body[10]


def test_layered_body_refuses_a_copy_before_its_template() -> None:
    real = (Alloc("o0_x", (1,)), Free("o0_x"))
    with pytest.raises(ValueError, match="out of order"):
        LayeredBody(real, [(1, 2, 0, 1)], _shift)
