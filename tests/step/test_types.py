"""Dimensions, data types, stream types, evaluation and stop tokens (seed 000 §3.1)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import sympy as sp

from torch2step.errors import StepTypeError
from torch2step.step import (
    DONE,
    BufferType,
    Index,
    MaxOver,
    RaggedDim,
    SelectorType,
    Stop,
    StreamType,
    StreamValue,
    TileType,
    TupleType,
    decode_tokens,
    dyn,
    encode_tokens,
    evaluate,
    stream_type,
    sum_over,
    types_equal,
)
from torch2step.step.dims import free_indices
from torch2step.step.types import absorb_ragged
from torch2step.step.values import StepRuntimeError

B, N = dyn("B"), dyn("N")
i = Index("i")
L = sp.IndexedBase("L")


def test_tile_types_and_sizes() -> None:
    t = TileType((16, 64), "bf16")
    assert t.is_static and t.nbytes() == 16 * 64 * 2
    d = TileType((N, 64))
    assert not d.is_static and d.nbytes() == 256 * N
    assert str(d) == "Tile[N, 64] fp32"
    with pytest.raises(StepTypeError, match="two-dimensional"):
        TileType((1, 2, 3))
    with pytest.raises(StepTypeError, match="unknown tile element type"):
        TileType((1, 2), "fp8")


def test_selector_buffer_tuple_types() -> None:
    assert SelectorType(9).nbytes() == 2 and str(SelectorType(8, 2)) == "Sel[8, k=2]"
    with pytest.raises(StepTypeError):
        SelectorType(4, 5)
    buf = BufferType(TileType((2, 2)), (N, 3))
    assert buf.rank == 2 and buf.card() == 3 * N and buf.buffer_bytes() == 48 * N
    tup = TupleType((TileType((1, 4)), SelectorType(4)))
    assert tup.nbytes() == 17
    with pytest.raises(StepTypeError):
        TupleType((TileType((1, 1)),))


def test_ragged_dim_binds_to_outer_axis_and_sums() -> None:
    r = RaggedDim("L", B)
    assert r.expr == L[i] and r.total() == sp.Sum(L[i], (i, 0, B - 1))
    st = stream_type(TileType((16, 64)), (1, B, r, 4))
    assert st.index == (None, i, None, None) and st.rank == 3
    assert st.card() == 4 * sp.Sum(L[i], (i, 0, B - 1))
    assert st.total_bytes() == 16384 * sp.Sum(L[i], (i, 0, B - 1))
    assert str(st) == "Strm<Tile[16, 64] fp32, 3>[1, B:i, L[i], 4]"
    assert evaluate(st.card(), B=3, L=[2, 0, 5]) == 28
    with pytest.raises(StepTypeError, match="no outer axis has extent N"):
        stream_type(TileType((1, 1)), (1, B, RaggedDim("L", N)))


def test_ragged_sizes_and_types_pickle() -> None:
    # an Index keeps its class and assumptions through pickling (a stream type or a formula
    # sent to or from another process)
    st = stream_type(TileType((16, 64)), (1, B, RaggedDim("L", B), 4))
    back = pickle.loads(pickle.dumps(st))
    assert back == st and back.card() == st.card()
    (j,) = free_indices(back.shape[2])
    assert type(j) is Index and j.is_integer and j.is_nonnegative


def test_stream_type_check_rejects_unbound_index() -> None:
    with pytest.raises(StepTypeError, match="no outer axis defines"):
        StreamType(TileType((1, 1)), (1, L[i])).check()
    with pytest.raises(StepTypeError, match="element type uses index"):
        StreamType(TileType((L[i], 1)), (1, B)).check()
    with pytest.raises(StepTypeError, match="index names two axes"):
        StreamType(TileType((1, 1)), (B, B), (i, i)).check()


def test_peak_is_max_over_existing_elements() -> None:
    r = RaggedDim("L", B)
    st = stream_type(TileType((r.expr, 8)), (1, B), ragged=[r])
    peak = st.peak(st.dtype.nbytes())
    assert peak.has(MaxOver)
    assert evaluate(peak, B=3, L=[2, 7, 5]) == 7 * 32
    assert evaluate(peak, B=0, L=[]) == 0
    static = StreamType(TileType((4, 4)), (1, 3)).peak(64)
    assert static == 64
    dynamic = StreamType(TileType((4, 4)), (1, N)).peak(64)
    assert evaluate(dynamic, N=0) == 0 and evaluate(dynamic, N=5) == 64


def test_sum_over_pulls_out_constant_factors() -> None:
    assert sum_over(4 * L[i], i, B) == 4 * sp.Sum(L[i], (i, 0, B - 1))
    assert sum_over(sp.Integer(4), i, B) == 4 * B
    assert sum_over(L[i] + 2, i, B) == sp.Sum(L[i], (i, 0, B - 1)) + 2 * B


def test_evaluate_formulas() -> None:
    e = sp.ceiling(sp.Sum(L[i], (i, 0, B - 1)) / 16) + sp.Piecewise((1, N > 0), (0, True))
    assert evaluate(e, B=2, N=0, L=[10, 30]) == 3
    assert evaluate(sp.Rational(3, 2) * 4) == 6
    assert evaluate(sp.Max(B, 3) + sp.Mod(7, B), B=4) == 7
    with pytest.raises(StepTypeError, match="no value for N"):
        evaluate(N + 1)
    with pytest.raises(StepTypeError, match=r"no value for L\[2\]"):
        evaluate(sp.Sum(L[i], (i, 0, 2)), L=[1, 2])


def test_types_equal_up_to_index_names() -> None:
    j = Index("j")
    a = StreamType(TileType((1, 1)), (1, B, L[i]), (None, i, None))
    b = StreamType(TileType((1, 1)), (1, B, L[j]), (None, j, None))
    c = StreamType(TileType((1, 1)), (1, B, sp.IndexedBase("K")[j]), (None, j, None))
    assert types_equal(a, b) and not types_equal(a, c)


def test_absorb_ragged_introduces_fresh_symbols() -> None:
    # the axis that L[i] is indexed by is gone: L[i] becomes a fresh ragged dim
    shape, index, dtype = absorb_ragged((N, L[i]), (None, None), TileType((L[i], 4)), "p_r")
    assert str(shape[1]) == "p_r0[p_r_i0]" and index[0] == Index("p_r_i0")
    assert str(dtype) == "Tile[p_r1[p_r_i0, p_r_i1], 4] fp32"
    same = absorb_ragged((B, L[i]), (i, None), TileType((1, 1)), "x")
    assert same[0] == (B, L[i])


# ---------------------------------------------------------------- stop tokens (seed 003 §III-A)


@pytest.mark.parametrize(
    ("tensor", "tokens"),
    [
        ([[0, 1], [2]], [0, 1, Stop(1), 2, Stop(2)]),
        ([[]], [Stop(1), Stop(2)]),
        ([[], []], [Stop(1), Stop(1), Stop(2)]),
        ([], [Stop(2)]),
        ([[], [0]], [Stop(1), 0, Stop(2)]),
        ([[0], []], [0, Stop(1), Stop(1), Stop(2)]),
    ],
)
def test_revet_encoding_of_rank2_tensors(tensor: list, tokens: list) -> None:
    assert encode_tokens([tensor], 2) == [*tokens, DONE]
    assert decode_tokens([*tokens, DONE], 2) == [tensor]


def test_stream_encoding_nested_and_multiple_tensors() -> None:
    assert encode_tokens([[[[]]]], 3) == [Stop(1), Stop(3), DONE]
    assert encode_tokens([[[[0]]]], 3) == [0, Stop(3), DONE]
    two = [[[1, 2]], [[3]]]
    assert encode_tokens(two, 2) == [1, 2, Stop(2), 3, Stop(2), DONE]
    assert encode_tokens([], 2) == [DONE]
    assert encode_tokens([5, 6], 0) == [5, 6, DONE]
    v = StreamValue.from_tokens([1, 2, Stop(2), 3, Stop(2), DONE], 2)
    assert v.data == two and list(v.elements()) == [1, 2, 3]


def test_decode_errors() -> None:
    with pytest.raises(StepRuntimeError, match="no done token"):
        decode_tokens([1, Stop(1)], 1)
    with pytest.raises(StepRuntimeError, match="stop token S3"):
        decode_tokens([Stop(3), DONE], 2)
    with pytest.raises(StepRuntimeError, match="open dimension"):
        decode_tokens([1, DONE], 1)


def test_round_trip_random_nested(rng: np.random.Generator) -> None:
    def tensor(depth: int) -> list | int:
        if depth == 0:
            return int(rng.integers(100))
        return [tensor(depth - 1) for _ in range(int(rng.integers(0, 3)))]

    for rank in range(4):
        for _ in range(50):
            data = [tensor(rank) for _ in range(int(rng.integers(0, 3)))]
            assert decode_tokens(encode_tokens(data, rank), rank) == data


def test_if_then_else_conditions_evaluate() -> None:
    # sympy may simplify a Piecewise condition into ITE(c, a, b); sizes must still evaluate
    import sympy as sp

    from torch2step.step.evaluate import evaluate

    n = sp.Symbol("n", integer=True, nonnegative=True)
    cond = sp.ITE(n > 0, n > 0, False)
    size = n * sp.Piecewise((1, cond), (0, True))
    assert evaluate(size, n=3) == 3
    assert evaluate(size, n=0) == 0
