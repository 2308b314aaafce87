"""Graph builder, verifier and printer."""

from __future__ import annotations

import dataclasses

import pytest

from torch2step.errors import StepTypeError
from torch2step.step import (
    Graph,
    Map,
    OffChipTensor,
    Program,
    StreamType,
    TileType,
    Value,
    dyn,
    fn,
    verify,
    zeros,
)

M = dyn("M")

GOLDEN = """\
step.graph tiny {
  tensor a: [16*M, 64] fp32
  tensor b: [64, 32] fp32
  tensor c: [16*M, 32] fp32
  %load0 = LinearOffChipLoad(; tensor=a, tile=Tile[16, 32] fp32, stride=[2, 1], out_shape=[M, 2], base=0) : Strm<Tile[16, 32] fp32, 2>[1, M, 2]
  %buf0 = Bufferize(%load0; rank=1) : Strm<Buf<Tile[16, 32] fp32>[2], 1>[1, M]
  %load1 = LinearOffChipLoad(%buf0; tensor=b, tile=Tile[32, 32] fp32, stride=[1], out_shape=[2], base=0) : Strm<Tile[32, 32] fp32, 2>[1, M, 2]
  %strm0 = Streamify(%buf0, %buf0; stride=None, out_shape=None) : Strm<Tile[16, 32] fp32, 2>[1, M, 2]
  %zip0 = Zip(%strm0, %load1) : Strm<(Tile[16, 32] fp32, Tile[32, 32] fp32), 2>[1, M, 2]
  %map0 = Map(%zip0; fn=matmul) : Strm<Tile[16, 32] fp32, 2>[1, M, 2]
  %accum0 = Accum(%map0; fn=add, init=zeros(dtype='fp32', shape=(16, 32)), rank=1) : Strm<Tile[16, 32] fp32, 1>[1, M]
  %part0.0, %part0.1 = Partition(%accum0, %sel; num_consumers=2)
      %part0.0 : Strm<Tile[16, 32] fp32, 0>[part0_n0]
      %part0.1 : Strm<Tile[16, 32] fp32, 0>[part0_n1]
  LinearOffChipStore(%accum0; tensor=c, base=0)
  output hot = %part0.0
  output cold = %part0.1
}"""


def _tiny() -> Graph:
    from torch2step.step import SelectorType

    g = Graph("tiny")
    a = g.tensor("a", (16 * M, 64))
    b = g.tensor("b", (64, 32))
    c = g.tensor("c", (16 * M, 32))
    a_t = g.linear_load(a, (16, 32))
    a_buf = g.bufferize(a_t, 1)
    b_t = g.linear_load(b, (32, 32), ref=a_buf, out_shape=(2,), stride=(1,))
    prod = g.map("matmul", g.streamify(a_buf, a_buf), b_t)
    c_t = g.accum(prod, "add", zeros(16, 32), 1)
    hot, cold = g.partition(c_t, g.input("sel", SelectorType(2, 1), (1, M)), 2)
    g.linear_store(c_t, c)
    g.output("hot", hot)
    g.output("cold", cold)
    return g


def test_printer_golden() -> None:
    text = str(_tiny().build())
    # the selector input line sits with the other declarations
    assert text.replace("  input %sel : Strm<Sel[2, k=1], 1>[1, M]\n", "") == GOLDEN
    assert "  input %sel : Strm<Sel[2, k=1], 1>[1, M]\n" in text


def test_printer_is_deterministic() -> None:
    assert str(_tiny().build()) == str(_tiny().build())


def test_builder_error_names_node_and_shows_ir() -> None:
    g = Graph("bad")
    a = g.tensor("a", (32, 32))
    x = g.linear_load(a, (16, 16))
    w = g.linear_load(a, (16, 32))
    e = g.map("exp", x)
    with pytest.raises(StepTypeError) as info:
        g.map("matmul", e, w, name="mm")
    msg = str(info.value)
    assert msg.startswith("Zip %zip0: all zipped streams have the same shape")
    assert "IR around it:" in msg and "%map0 = Map(%load0; fn=exp)" in msg
    assert ">>>   %zip0 = Zip(%map0, %load1) : <type rule failed>" in msg


def test_builder_rejects_bad_names() -> None:
    g = Graph()
    g.tensor("a", (2, 2))
    with pytest.raises(StepTypeError, match="already used"):
        g.tensor("a", (2, 2))
    with pytest.raises(StepTypeError, match="not a valid name"):
        g.tensor("no good", (2, 2))


def _valid() -> Program:
    g = Graph("v")
    a = g.tensor("a", (4, 4))
    x = g.linear_load(a, (2, 2))
    y = g.map("exp", x, name="ex")
    g.output("y", y)
    return g.build()


def test_verifier_catches_input_type_disagreement() -> None:
    prog = _valid()
    bad_in = Value("load0", StreamType(TileType((2, 4)), (1, 2, 2)))
    ex = prog.nodes[1]
    assert isinstance(ex, Map)
    nodes = (prog.nodes[0], dataclasses.replace(ex, input=bad_in))
    broken = dataclasses.replace(prog, nodes=nodes)
    with pytest.raises(StepTypeError) as info:
        verify(broken)
    msg = str(info.value)
    assert "node %ex (Map): input %load0 has type" in msg
    assert ">>>   %ex = Map(%load0; fn=exp)" in msg


def test_verifier_catches_wrong_recorded_output() -> None:
    prog = _valid()
    wrong = (Value("ex", StreamType(TileType((2, 2)), (1, 2, 3))),)
    broken = dataclasses.replace(prog, node_outputs=(prog.node_outputs[0], wrong))
    with pytest.raises(StepTypeError, match="recorded as .* but the rule gives"):
        verify(broken)


def test_verifier_catches_rule_violation_in_edited_graph() -> None:
    prog = _valid()
    ex = prog.nodes[1]
    broken = dataclasses.replace(
        prog, nodes=(prog.nodes[0], dataclasses.replace(ex, fn=fn("matmul")))
    )
    with pytest.raises(StepTypeError, match=r"node %ex \(Map\): Map %ex: function matmul takes 2"):
        verify(broken)


def test_verifier_catches_undefined_dangling_and_duplicates() -> None:
    prog = _valid()
    ex = prog.nodes[1]
    ghost = dataclasses.replace(ex, input=Value("ghost", prog.node_outputs[0][0].type))
    with pytest.raises(StepTypeError, match="input %ghost is not produced before this node"):
        verify(dataclasses.replace(prog, nodes=(prog.nodes[0], ghost)))
    with pytest.raises(StepTypeError, match="stream %ex dangles"):
        verify(dataclasses.replace(prog, outputs=()))
    dup = dataclasses.replace(
        prog,
        nodes=(*prog.nodes, prog.nodes[1]),
        node_outputs=(*prog.node_outputs, prog.node_outputs[1]),
    )
    with pytest.raises(StepTypeError, match="two nodes share this name"):
        verify(dup)
    stray = dataclasses.replace(prog.nodes[0], tensor=OffChipTensor("zz", (4, 4)))
    with pytest.raises(StepTypeError, match="off-chip tensor zz is not declared"):
        verify(dataclasses.replace(prog, nodes=(stray, prog.nodes[1])))


def test_unused_input_is_reported() -> None:
    g = Graph("u")
    g.input("lonely", TileType((1, 1)), (1, 2))
    with pytest.raises(StepTypeError, match="input %lonely is never used"):
        g.build()


def test_program_lookup() -> None:
    prog = _valid()
    assert prog.node("ex").op_name == "Map"
    assert set(prog.values()) == {"load0", "ex"}
    with pytest.raises(KeyError):
        prog.node("nope")
