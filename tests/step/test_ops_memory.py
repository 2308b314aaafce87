"""Memory operators: shape rules (Appendix A tables 2–3), meaning on data, byte counts."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step import (
    ADDR,
    BufferType,
    Graph,
    Index,
    RaggedDim,
    StepRuntimeError,
    StreamType,
    TileType,
    TupleType,
    dyn,
    metrics,
    run,
)

B, N = dyn("B"), dyn("N")
i = Index("i")
L = sp.IndexedBase("L")


def _tiles(arr: np.ndarray, r: int, c: int) -> list[np.ndarray]:
    return [
        arr[a : a + r, b : b + c]
        for a in range(0, arr.shape[0], r)
        for b in range(0, arr.shape[1], c)
    ]


# ---------------------------------------------------------------- LinearOffChipLoad


def test_linear_load_shape_static_dynamic_ragged() -> None:
    g = Graph()
    a = g.tensor("a", (64, 128))
    x = g.linear_load(a, (16, 64))
    assert x.type == StreamType(TileType((16, 64)), (1, 4, 2))
    ref = g.input("ref", ADDR, (1, B))
    y = g.linear_load(a, (16, 64), ref, out_shape=(2,), stride=(1,))
    assert y.type.shape == (1, B, 2) and y.type.rank == 2
    rag = g.input("rag", ADDR, (1, B, RaggedDim("L", B)))
    z = g.linear_load(a, (16, 64), rag, out_shape=(8,), stride=(1,))
    assert z.type.shape == (1, B, L[i], 8) and z.type.index[1] == i
    big = g.tensor("big", (16 * N, 64))
    w = g.linear_load(big, (16, 64))
    assert w.type.shape == (1, N, 1)


def test_linear_load_errors() -> None:
    g = Graph()
    a = g.tensor("a", (60, 64))
    with pytest.raises(StepTypeError, match="not a whole number of \\[16, 64\\] tiles"):
        g.linear_load(a, (16, 64), name="bad")
    b = g.tensor("b", (64, 64))
    with pytest.raises(
        StepTypeError, match=r"LinearOffChipLoad %oob: the affine read stays inside"
    ):
        g.linear_load(b, (16, 64), out_shape=(5,), stride=(1,), name="oob")
    c = g.tensor("c", (64, 64), "bf16")
    with pytest.raises(StepTypeError, match="differs from tensor c dtype bf16"):
        g.linear_load(c, TileType((16, 64), "fp32"))


def test_linear_load_affine_reads_and_bytes(rng: np.random.Generator) -> None:
    g = Graph()
    a = g.tensor("a", (4, 6))
    ref = g.input("ref", ADDR, (1, 2))
    # column-major walk over the 2x3 tile grid, repeated for each of the 2 ref elements
    x = g.linear_load(a, (2, 2), ref, out_shape=(3, 2), stride=(1, 3))
    g.output("x", x)
    A = rng.standard_normal((4, 6)).astype(np.float32)
    res = run(g.build(), tensors={"a": A}, streams={"ref": [[[[0]], [[1]]]]})
    tiles = _tiles(A, 2, 2)  # row-major tile order
    got = res.outputs["x"].data[0]
    assert len(got) == 2
    for rep in got:
        flat = [t for row in rep for t in row]
        expect = [tiles[0], tiles[3], tiles[1], tiles[4], tiles[2], tiles[5]]
        assert all(np.array_equal(p, q) for p, q in zip(flat, expect))
    assert res.read_bytes[g.build().nodes[0].name] == 2 * 6 * 16


def test_linear_load_broadcast_with_zero_stride() -> None:
    g = Graph()
    a = g.tensor("a", (2, 2))
    x = g.linear_load(a, (2, 2), out_shape=(3,), stride=(0,))
    g.output("x", x)
    A = np.arange(4.0).reshape(2, 2)
    res = run(g.build(), tensors={"a": A})
    assert [t.tolist() for t in res.outputs["x"].elements()] == [A.tolist()] * 3
    assert sum(res.read_bytes.values()) == 3 * 16


# ---------------------------------------------------------------- LinearOffChipStore


def test_linear_store_round_trip_and_errors(rng: np.random.Generator) -> None:
    g = Graph()
    a = g.tensor("a", (8, 8))
    c = g.tensor("c", (8, 8))
    g.linear_store(g.linear_load(a, (4, 4)), c)
    A = rng.standard_normal((8, 8)).astype(np.float32)
    res = run(g.build(), tensors={"a": A})
    assert np.array_equal(res.tensors["c"], A)
    assert sum(res.write_bytes.values()) == 256

    g2 = Graph()
    d = g2.tensor("d", (4, 4))
    small = g2.tensor("s", (4, 4))
    x = g2.linear_load(g2.tensor("e", (8, 8)), (4, 4))
    with pytest.raises(StepTypeError, match="the stream fits in the tensor"):
        g2.linear_store(x, small)
    dyn_tile = g2.input("t", TileType((N, 4)), (1, 2))
    with pytest.raises(StepTypeError, match="statically sized tiles"):
        g2.linear_store(dyn_tile, d)


# ---------------------------------------------------------------- Random loads / stores


def test_random_load_ragged_addresses(rng: np.random.Generator) -> None:
    g = Graph()
    kv = g.tensor("kv", (12, 4))
    addr = g.input("addr", ADDR, (1, B, RaggedDim("L", B)))
    t = g.random_load(addr, kv, (2, 4))
    assert t.type.shape == (1, B, L[i]) and t.type.dtype == TileType((2, 4))
    g.output("t", t)
    KV = rng.standard_normal((12, 4)).astype(np.float32)
    addrs = [[[[[5]], [[0]]], [], [[[3]]]]]
    res = run(g.build(), tensors={"kv": KV}, streams={"addr": addrs}, env={"L": [2, 0, 1]})
    out = res.outputs["t"].data[0]
    assert [len(r) for r in out] == [2, 0, 1]
    assert np.array_equal(out[0][0], KV[10:12]) and np.array_equal(out[2][0], KV[6:8])
    assert sum(res.read_bytes.values()) == 3 * 32
    assert res.bindings["B"] == 3
    with pytest.raises(StepRuntimeError, match="tile address 6 is outside the 6 tiles"):
        run(g.build(), tensors={"kv": KV}, streams={"addr": [[[[[6]]]]]})


def test_random_load_rejects_non_address_stream() -> None:
    g = Graph()
    kv = g.tensor("kv", (12, 4))
    bad = g.input("bad", TileType((1, 1)), (1, 3))
    with pytest.raises(StepTypeError, match=r"RandomOffChipLoad %r: raddr carries \[1,1\] integer"):
        g.random_load(bad, kv, (2, 4), name="r")


def test_random_load_rows_reads_runs_of_rows(rng: np.random.Generator) -> None:
    """RandomOffChipLoadRows: per (row, r) address one [r, 4] tile, exactly the rows used."""
    g = Graph()
    kv = g.tensor("kv", (10, 4))
    span = TupleType((ADDR, ADDR))
    addr = g.input("addr", span, (1, 3))
    t = g.random_load_rows(addr, kv, 3, name="rows")
    assert t.type.shape == (1, 3) and t.type.dtype.shape[1] == 4
    g.output("t", t)
    prog = g.build()
    KV = rng.standard_normal((10, 4)).astype(np.float32)

    def pair(row: int, r: int) -> tuple:
        return (np.array([[row]]), np.array([[r]]))

    res = run(prog, tensors={"kv": KV}, streams={"addr": [[pair(0, 3), pair(5, 2), pair(9, 1)]]})
    out = res.outputs["t"].data[0]
    assert [o.shape for o in out] == [(3, 4), (2, 4), (1, 4)]
    assert np.array_equal(out[1], KV[5:7]) and np.array_equal(out[2], KV[9:10])
    assert res.read_bytes["rows"] == 6 * 4 * 4  # the rows used, not three full tiles
    assert metrics(prog).evaluate(res.bindings)["offchip_bytes"] == 6 * 4 * 4
    assert res.onchip_bytes["rows"] == 2 * 3 * 4 * 4  # the largest tile, double-buffered
    for bad in (pair(8, 3), pair(0, 4), pair(0, 0)):  # past the end, above the cap, empty
        with pytest.raises(StepRuntimeError, match="addresses give 1..3 rows"):
            run(prog, tensors={"kv": KV}, streams={"addr": [[bad, pair(0, 1), pair(1, 1)]]})
    with pytest.raises(StepTypeError, match=r"raddr carries \(row, row count\) pairs"):
        g.random_load_rows(g.input("a1", ADDR, (1, 2)), kv, 3)
    with pytest.raises(StepTypeError, match="tiles are whole rows"):
        g.random_load_rows(addr, g.tensor("wide", (10, 4, 2)), 3)


def test_random_store_scatter_and_errors() -> None:
    g = Graph()
    src = g.tensor("src", (2, 6))
    dst = g.tensor("dst", (2, 8))
    data = g.flatten(g.linear_load(src, (2, 2)), 0, 1)  # [1, 3]
    addr = g.input("addr", ADDR, (1, 3))
    ack = g.random_store(addr, data, dst)
    assert ack.type.shape == (1, 3) and str(ack.type.dtype) == "Tile[1, 1] bool"
    S = np.arange(12.0).reshape(2, 6)
    res = run(g.build(), tensors={"src": S}, streams={"addr": [[[[3]], [[0]], [[2]]]]})
    D = res.tensors["dst"]
    assert np.array_equal(D[:, 6:8], S[:, 0:2]) and np.array_equal(D[:, 0:2], S[:, 2:4])
    assert np.array_equal(D[:, 4:6], S[:, 4:6]) and not D[:, 2:4].any()
    assert sum(res.write_bytes.values()) == 48

    g2 = Graph()
    d2 = g2.tensor("d", (2, 8))
    a2 = g2.input("a", ADDR, (1, 4))
    x2 = g2.input("x", TileType((2, 2)), (1, 3))
    with pytest.raises(StepTypeError, match="waddr and wdata have the same shape"):
        g2.random_store(a2, x2, d2)


# ---------------------------------------------------------------- Bufferize / Streamify


def test_bufferize_shapes_and_ragged_rules() -> None:
    g = Graph()
    x = g.input("x", TileType((2, 2)), (1, B, RaggedDim("L", B), 4))
    b2 = g.bufferize(x, 2)
    assert b2.type.shape == (1, B) and b2.type.dtype == BufferType(TileType((2, 2)), (L[i], 4))
    b1 = g.bufferize(x, 1)
    assert b1.type.shape == (1, B, L[i])
    with pytest.raises(StepTypeError, match="Bufferize %b3: only the outermost buffered"):
        g.bufferize(x, 3, name="b3")
    with pytest.raises(StepTypeError, match="1 <= rank <= input rank"):
        g.bufferize(x, 4)
    d = g.input("d", TileType((N, 2)), (1, 3))
    with pytest.raises(StepTypeError, match="statically sized tiles"):
        g.bufferize(d, 1)


def test_streamify_linear_ragged_and_repeat(rng: np.random.Generator) -> None:
    g = Graph()
    x = g.input("x", TileType((1, 2)), (1, B, RaggedDim("L", B)))
    buf = g.bufferize(x, 1)  # [1, B] of Buf[L[i]]
    ref = g.repeat(buf, 2)  # read every buffer twice (seed 000 Fig. 12)
    y = g.streamify(buf, ref)
    assert y.type.shape == (1, B, 2, L[i]) and y.type.index[1] == i
    g.output("y", y)
    rows = [[rng.standard_normal((1, 2)).astype(np.float32) for _ in range(n)] for n in (3, 1)]
    res = run(g.build(), streams={"x": [rows]})
    out = res.outputs["y"].data[0]
    for b, n in enumerate((3, 1)):
        assert len(out[b]) == 2
        for rep in out[b]:
            assert len(rep) == n and all(np.array_equal(p, q) for p, q in zip(rep, rows[b]))
    # buffer b holds n tiles of 8 bytes: |tile| + 2 * n * 8, the largest is n = 3
    assert res.onchip_bytes["buf0"] == 8 + 2 * 3 * 8


def test_streamify_affine_transpose_and_errors() -> None:
    g = Graph()
    x = g.input("x", TileType((1, 1)), (1, 2, 3))
    buf = g.bufferize(x, 2)  # one buffer [2, 3]
    y = g.streamify(buf, buf, stride=(1, 3), out_shape=(3, 2))  # transposed read
    assert y.type.shape == (1, 3, 2)
    g.output("y", y)
    vals = [[[np.full((1, 1), 3 * r + c, np.float32) for c in range(3)] for r in range(2)]]
    res = run(g.build(), streams={"x": [vals[0]]})
    got = [[float(t[0, 0]) for t in row] for row in res.outputs["y"].data[0]]
    assert got == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(StepTypeError, match="affine read stays inside"):
        g.streamify(buf, buf, stride=(1, 3), out_shape=(3, 3))

    g2 = Graph()
    x2 = g2.input("x", TileType((1, 1)), (1, N))
    buf2 = g2.bufferize(x2, 1)
    with pytest.raises(StepTypeError, match="dynamically sized buffer is read linearly"):
        g2.streamify(buf2, buf2, stride=(1,), out_shape=(2,))
    other = g2.input("o", ADDR, (2, 4))
    with pytest.raises(StepTypeError, match="outer b\\+1 dims of ref equal"):
        g2.streamify(buf2, other)
    with pytest.raises(StepTypeError, match="input carries buffer references"):
        g2.streamify(x2, x2)
