"""Builder and printer: a small program set built with context managers, printed to golden text."""

from __future__ import annotations

import pytest

import lowering as L
from lowering import ProgramBuilder, ProgramError, affine, region

GOLDEN = """\
program set 'demo': 3 programs, 2 channels, 3 tensors
meta note = small example
tensor X: fp32[8, 4] (32 el)
tensor Y: fp32[8, 4] (32 el)
tensor lens: int32[2] (2 el)
channel tiles: core 0 -> cores 1, 2 (depth 4)
channel count: core 0 -> core 1 (depth default)
barrier done: cores 0, 1

core 0:
  alloc t: fp32[2, 4]
  load_value n <- lens[0]
  send_value count <- n
  loop 4 as i:
    load t <- X[2*i:+2, 0:4]
    send tiles <- t
  free t
  barrier done

core 1:
  alloc t: fp32[2, 4]
  recv_value n <- count
  loop 4 as i:
    recv t <- tiles
    if n > i:
      compute t <- add(t, t) [fp32]
    else:
      set m = 2*i-1
    store Y[2*i:+2, 0:4] += t
  free t
  barrier done

core 2:
  alloc t: fp32[2, 4]
  loop 4:
    recv t <- tiles
    compute t <- zeros() {shape=2x4} [fp32]
  free t
"""


def build_demo() -> L.ProgramSet:
    b = ProgramBuilder("demo")
    b.tensor("X", (8, 4), "fp32")
    b.tensor("Y", (8, 4), "fp32")
    b.tensor("lens", (2,), "int32")
    b.channel("tiles", src=0, dsts=(1, 2), depth=4)
    b.channel("count", src=0, dsts=1)
    b.barrier_group("done", (0, 1))
    b.meta("note", "small example")
    with b.core(0) as p:
        p.alloc("t", (2, 4), "fp32")
        p.load_value("n", "lens", (0,))
        p.send_value("count", "n")
        with p.loop(4, var="i"):
            p.load("t", "X", region((affine(0, i=2), 0), (2, 4)))
            p.send("tiles", "t")
        p.free("t")
        p.barrier("done")
    with b.core(1) as p:
        p.alloc("t", (2, 4), "fp32")
        p.recv_value("count", "n")
        with p.loop(4, var="i"):
            p.recv("tiles", "t")
            with p.if_("n", ">", "i"):
                p.compute("add", "t", ("t", "t"), dtype="fp32")
            with p.else_():
                p.set("m", affine(-1, i=2))
            p.store("t", "Y", region((affine(0, i=2), 0), (2, 4)), accumulate=True)
        p.free("t")
        p.barrier("done")
    with b.core(2) as p:
        p.alloc("t", (2, 4), "fp32")
        with p.loop(4):
            p.recv("tiles", "t")
            p.compute("zeros", "t", params={"shape": "2x4"}, dtype="fp32")
        p.free("t")
    return b.build()


def test_golden_print() -> None:
    assert L.format_programs(build_demo()) == GOLDEN


def test_build_is_frozen_and_deterministic() -> None:
    a, b = build_demo(), build_demo()
    assert a == b
    assert [p.core for p in a.programs] == [0, 1, 2]
    loop = a.programs[1].body[2]
    assert isinstance(loop, L.Loop) and loop.var == "i"
    branch = loop.body[1]
    assert isinstance(branch, L.If)
    assert branch.cond == L.Cond("n", ">", "i")
    assert branch.orelse == (L.Set("m", L.Affine(-1, (("i", 2),))),)
    with pytest.raises(AttributeError):
        a.name = "other"  # type: ignore[misc]


def test_format_value_and_region() -> None:
    assert L.format_value(7) == "7"
    assert L.format_value("n") == "n"
    assert L.format_value(L.Affine(0, ())) == "0"
    assert L.format_value(L.Affine(3, (("t", 4), ("u", -1)))) == "4*t-u+3"
    assert L.format_value(L.Affine(-2, (("t", -3),))) == "-3*t-2"
    assert L.format_region("A", None) == "A"
    assert L.format_region("A", region((0, "r"), (4, "n"))) == "A[0:4, r:+n]"


def test_compute_params_are_sorted() -> None:
    b = ProgramBuilder()
    b.core(0).compute("zeros", "z", params={"shape": "2x2", "alpha": 1}, dtype="fp32")
    (instr,) = b.build().programs[0].body
    assert instr.params == (("alpha", 1), ("shape", "2x2"))


def test_builder_misuse() -> None:
    b = ProgramBuilder()
    b.tensor("X", (2,))
    with pytest.raises(ProgramError, match="tensor 'X' is declared twice"):
        b.tensor("X", (2,))
    b.channel("c", 0, 1)
    with pytest.raises(ProgramError, match="channel 'c' is declared twice"):
        b.channel("c", 1, 0)
    b.barrier_group("g", (0, 1))
    with pytest.raises(ProgramError, match="barrier group 'g' is declared twice"):
        b.barrier_group("g", (0,))
    p = b.core(0)
    with pytest.raises(ProgramError, match="else_\\(\\) must directly follow"):
        with p.else_():
            pass
    loop = p.loop(2)
    loop.__enter__()
    with pytest.raises(ProgramError, match="loop 2 block is still open"):
        b.build()
    with pytest.raises(ProgramError, match="one of each per dimension"):
        region((0, 0), (1,))


def test_exception_inside_block_leaves_builder_usable() -> None:
    b = ProgramBuilder()
    p = b.core(0)
    with pytest.raises(RuntimeError):
        with p.loop(3):
            raise RuntimeError("boom")
    p.barrier("g")
    assert b.build().programs[0].body == (L.Barrier("g"),)
