"""Built-in tile functions (registered on import; see :mod:`torch2step.step.functions`).

FLOP counts are per application on one tile: a multiply-add is 2 FLOPs; elementwise
add/sub/mul/div/max, scale, exp, relu and row reductions 1 per element; SiLU 4 per element
(exp, add, divide, multiply) and SiLU-multiply 5.  Matrix products have the on-chip scratch of
STeP §4.1: ``(16 x in_tile_col + |weight tile|)`` elements.

Map:    matmul, matmul_t (A x B^T), add, sub, mul, div, maximum (broadcasting [m,1]/[1,n]),
        scale(alpha), exp, relu, silu, silu_mul, row_max, row_sum, transpose,
        affine(scale, offset) (integer address arithmetic), softmax_finalize,
        get(index) (one member of a Zip tuple).
Update: matmul_acc, matmul_t_acc, online_softmax(scale) (FlashAttention-style running max /
        sum / output, STeP §5.1), retile_row (pack rows into a dynamically sized tile,
        STeP Fig. 2 "RetileRow").
Init:   zeros(shape, dtype), full(shape, value, dtype), online_softmax_init(rows, cols, dtype).
Flat:   retile_streamify(rows) (split a tile into row tiles, Fig. 2 "RetileStreamify"),
        split_cols(cols), iota(count) (addresses start..start+count-1),
        filter_padding (drop elements whose padding flag is set, Fig. 2 "FilterPadding").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import sympy as sp

from torch2step.errors import StepTypeError

from .dims import as_dim, dims_equal
from .functions import Fn, FnSpec, register_fn
from .types import DataType, TileType, TupleType

__all__ = ["NP_DTYPES", "gelu", "gelu_tanh", "np_dtype"]

NP_DTYPES: dict[str, Any] = {
    "fp32": np.float32,
    "bf16": np.float32,
    "fp16": np.float32,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}
"""numpy dtype used by the reference interpreter for each tile element type (fp32 compute)."""


def np_dtype(name: str) -> Any:
    return NP_DTYPES[name]


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU ``0.5 x (1 + erf(x / sqrt 2))`` (Hendrycks & Gimpel, "Gaussian Error Linear Units",
    §2), as ``torch.nn.functional.gelu``: the elementwise ``gelu`` of
    :mod:`~torch2step.step.fn_library_layers` and the gated ``gelu_mul`` of
    :mod:`~torch2step.step.fn_library_models`."""
    from scipy.special import erf  # imported on first use: scipy.special costs 0.15-0.25 s

    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(x.dtype, copy=False)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (Hendrycks & Gimpel, "Gaussian Error Linear Units", §2), as
    ``torch.nn.functional.gelu(approximate="tanh")``: the elementwise ``gelu_tanh`` of
    :mod:`~torch2step.step.fn_library_layers` and the gated ``gelu_tanh_mul`` of
    :mod:`~torch2step.step.fn_library_models`."""
    inner = float(np.sqrt(2.0 / np.pi)) * (x + 0.044715 * x**3)
    return (0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype, copy=False)


def _tile(f: Fn, t: DataType, what: str = "argument") -> TileType:
    if not isinstance(t, TileType):
        raise StepTypeError(f"function {f}: {what} must be a tile, got {t}")
    return t


def _eq(f: Fn, a: sp.Expr, b: sp.Expr, what: str) -> None:
    if not dims_equal(a, b):
        raise StepTypeError(f"function {f}: {what} differ: {sp.sstr(a)} != {sp.sstr(b)}")


def _init_shape(f: Fn) -> tuple[sp.Expr, sp.Expr]:
    """The ``shape`` parameter of an init function: two sizes, static or symbolic (a dynamic
    accumulator such as ``[N, 64]``; the interpreter substitutes the run's values)."""
    shape = tuple(as_dim(d) for d in f.get("shape", ()))
    if len(shape) != 2 or any(d.is_Integer and d < 0 for d in shape):
        raise StepTypeError(f"function {f}: shape must be two non-negative sizes")
    return shape[0], shape[1]


def _int_shape(f: Fn) -> tuple[int, int]:
    r, c = _init_shape(f)
    if not (r.is_Integer and c.is_Integer):
        raise StepTypeError(f"function {f}: shape {r, c} must be concrete to run")
    return int(r), int(c)


# ---------------------------------------------------------------- matrix products


def _mm_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a, b = _tile(f, args[0], "A"), _tile(f, args[1], "B")
    transposed = f.name.startswith("matmul_t")
    k_b = b.shape[1] if transposed else b.shape[0]
    n = b.shape[0] if transposed else b.shape[1]
    _eq(f, a.shape[1], k_b, "contraction sizes (A cols, B rows)")
    return TileType((a.shape[0], n), a.dtype)


def _mm_flops(f: Fn, args: tuple[DataType, ...]) -> sp.Expr:
    a, b = args[0], args[1]
    assert isinstance(a, TileType) and isinstance(b, TileType)
    out = _mm_rule(f, args)
    extra = out.shape[0] * out.shape[1] if f.name.endswith("_acc") else 0
    return 2 * a.shape[0] * a.shape[1] * out.shape[1] + extra


def _mm_scratch(f: Fn, args: tuple[DataType, ...]) -> sp.Expr:
    a, b = args[0], args[1]
    assert isinstance(a, TileType) and isinstance(b, TileType)
    return (16 * a.shape[1]) * a.itemsize + b.nbytes()


def _mm_scratch_value(f: Fn, itemsizes: tuple[int, ...], a: np.ndarray, b: np.ndarray) -> int:
    return 16 * a.shape[1] * itemsizes[0] + b.size * itemsizes[1]


def _mm(f: Fn, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a @ (b.T if f.name.startswith("matmul_t") else b)


for _name in ("matmul", "matmul_t"):
    register_fn(
        FnSpec(
            _name,
            "map",
            2,
            _mm_rule,
            _mm,
            flops=_mm_flops,
            scratch=_mm_scratch,
            scratch_value=_mm_scratch_value,
            doc="A x B" if _name == "matmul" else "A x B^T",
        )
    )


def _mm_acc_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    out = _mm_rule(f, args)
    acc_t = _tile(f, acc, "accumulator")
    _eq(f, out.shape[0], acc_t.shape[0], "product and accumulator rows")
    _eq(f, out.shape[1], acc_t.shape[1], "product and accumulator cols")
    return acc


for _name in ("matmul_acc", "matmul_t_acc"):
    register_fn(
        FnSpec(
            _name,
            "update",
            2,
            _mm_acc_rule,
            lambda f, a, b, acc: acc + _mm(f, a, b),
            flops=_mm_flops,
            scratch=_mm_scratch,
            scratch_value=_mm_scratch_value,
            doc="acc + A x B" if _name == "matmul_acc" else "acc + A x B^T",
        )
    )

# ---------------------------------------------------------------- elementwise


def _bcast_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a, b = _tile(f, args[0], "first argument"), _tile(f, args[1], "second argument")
    dims = []
    for x, y in zip(a.shape, b.shape):
        if dims_equal(x, y) or y == 1:
            dims.append(x)
        elif x == 1:
            dims.append(y)
        else:
            raise StepTypeError(
                f"function {f}: tile shapes {a} and {b} neither match nor broadcast"
            )
    return TileType(tuple(dims), a.dtype)


def _elems(t: TileType) -> sp.Expr:
    return t.shape[0] * t.shape[1]


_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "maximum": np.maximum,
}
for _name, _op in _BINARY.items():
    register_fn(
        FnSpec(
            _name,
            "map",
            2,
            _bcast_rule,
            (lambda op: lambda f, a, b: op(a, b).astype(a.dtype, copy=False))(_op),
            flops=lambda f, args: _elems(_bcast_rule(f, args)),
            doc=f"elementwise {_name} with [m,1]/[1,n] broadcasting",
        )
    )


def _same_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    return _tile(f, args[0])


def _silu(x: np.ndarray) -> np.ndarray:
    return (x / (1.0 + np.exp(-x))).astype(x.dtype, copy=False)


_UNARY: dict[str, tuple[Any, int]] = {
    "exp": (lambda f, x: np.exp(x), 1),
    "relu": (lambda f, x: np.maximum(x, 0), 1),
    "silu": (lambda f, x: _silu(x), 4),
    "scale": (lambda f, x: (x * float(f.get("alpha", 1.0))).astype(x.dtype), 1),
}
for _name, (_impl, _per) in _UNARY.items():
    register_fn(
        FnSpec(
            _name,
            "map",
            1,
            _same_rule,
            _impl,
            flops=(lambda per: lambda f, args: per * _elems(_tile(f, args[0])))(_per),
            doc=f"elementwise {_name}",
        )
    )


def _silu_mul_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a, b = _tile(f, args[0]), _tile(f, args[1])
    _eq(f, a.shape[0], b.shape[0], "rows")
    _eq(f, a.shape[1], b.shape[1], "cols")
    return a


register_fn(
    FnSpec(
        "silu_mul",
        "map",
        2,
        _silu_mul_rule,
        lambda f, a, b: _silu(a) * b,
        flops=lambda f, args: 5 * _elems(_tile(f, args[0])),
        doc="SiLU(a) * b (SwiGLU gate)",
    )
)


def _row_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a = _tile(f, args[0])
    return TileType((a.shape[0], 1), a.dtype)


register_fn(
    FnSpec(
        "row_max",
        "map",
        1,
        _row_rule,
        lambda f, x: x.max(axis=1, keepdims=True),
        flops=lambda f, args: _elems(_tile(f, args[0])),
        doc="max over each row",
    )
)
register_fn(
    FnSpec(
        "row_sum",
        "map",
        1,
        _row_rule,
        lambda f, x: x.sum(axis=1, keepdims=True),
        flops=lambda f, args: _elems(_tile(f, args[0])),
        doc="sum over each row",
    )
)
register_fn(
    FnSpec(
        "transpose",
        "map",
        1,
        lambda f, args: TileType(tuple(reversed(_tile(f, args[0]).shape)), args[0].dtype),
        lambda f, x: np.ascontiguousarray(x.T),
        doc="transpose a tile",
    )
)


def _affine_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    a = _tile(f, args[0])
    if a.dtype not in ("int32", "int64"):
        raise StepTypeError(f"function {f}: needs an integer tile, got {a}")
    return a


register_fn(
    FnSpec(
        "affine",
        "map",
        1,
        _affine_rule,
        lambda f, x: x * int(f.get("scale", 1)) + int(f.get("offset", 0)),
        flops=lambda f, args: 2 * _elems(_tile(f, args[0])),
        doc="integer x * scale + offset (address arithmetic)",
    )
)


def _get_rule(f: Fn, args: tuple[DataType, ...]) -> DataType:
    t, k = args[0], int(f.get("index", 0))
    if not isinstance(t, TupleType) or not 0 <= k < len(t.elems):
        raise StepTypeError(f"function {f}: needs a tuple with an element {k}, got {t}")
    return t.elems[k]


register_fn(
    FnSpec(
        "get",
        "map",
        1,
        _get_rule,
        lambda f, x: x[int(f.get("index", 0))],
        doc="element `index` of a Zip tuple (unzip)",
    )
)

# ---------------------------------------------------------------- online softmax (GQA)


def _softmax_state(f: Fn, acc: DataType) -> tuple[TileType, TileType, TileType]:
    if not (isinstance(acc, TupleType) and len(acc.elems) == 3):
        raise StepTypeError(f"function {f}: state must be a (max, sum, out) tuple, got {acc}")
    m, s, o = (_tile(f, t, "state member") for t in acc.elems)
    return m, s, o


def _osm_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    q, k, v = (_tile(f, t) for t in args)
    m, s, o = _softmax_state(f, acc)
    _eq(f, q.shape[1], k.shape[1], "q and k head dims")
    _eq(f, k.shape[0], v.shape[0], "k and v rows")
    for t in (m, s, o):
        _eq(f, t.shape[0], q.shape[0], "state rows and q rows")
    _eq(f, m.shape[1], 1, "running max cols")
    _eq(f, s.shape[1], 1, "running sum cols")
    _eq(f, o.shape[1], v.shape[1], "output and v cols")
    return acc


def _osm_flops(f: Fn, args: tuple[DataType, ...]) -> sp.Expr:
    q, k, v = (_tile(f, t) for t in args)
    g, d, t, dv = q.shape[0], q.shape[1], k.shape[0], v.shape[1]
    return 2 * g * t * d + 2 * g * t * dv + 5 * g * t + g * dv + 4 * g


def _osm_impl(f: Fn, q: np.ndarray, k: np.ndarray, v: np.ndarray, acc: tuple) -> tuple:
    m, s, o = acc
    if k.shape[0] == 0:
        return acc
    scores = (q @ k.T) * float(f.get("scale", 1.0))
    m_new = np.maximum(m, scores.max(axis=1, keepdims=True))
    p = np.exp(scores - m_new)
    alpha = np.exp(m - m_new)
    return (m_new, alpha * s + p.sum(axis=1, keepdims=True), alpha * o + p @ v)


register_fn(
    FnSpec(
        "online_softmax",
        "update",
        3,
        _osm_rule,
        _osm_impl,
        flops=_osm_flops,
        scratch=lambda f, args: (
            16 * args[0].shape[1] * args[0].itemsize  # type: ignore[attr-defined]
            + args[1].nbytes()
            + args[2].nbytes()
        ),
        scratch_value=lambda f, isz, q, k, v: (
            16 * q.shape[1] * isz[0] + k.size * isz[1] + v.size * isz[2]
        ),
        doc="(q, k, v) x (max, sum, out) -> (max, sum, out): one FlashAttention step",
    )
)


def _finalize_rule(f: Fn, args: tuple[DataType, ...]) -> DataType:
    m, s, o = (_tile(f, t) for t in args)
    _eq(f, s.shape[0], o.shape[0], "sum and output rows")
    return o


register_fn(
    FnSpec(
        "softmax_finalize",
        "map",
        3,
        _finalize_rule,
        lambda f, m, s, o: np.divide(o, s, out=np.zeros_like(o), where=s != 0),
        flops=lambda f, args: _elems(_tile(f, args[2])),
        doc="(max, sum, out) -> out / sum (0 for rows that saw no key)",
    )
)

from . import fn_library_pack as _pack  # noqa: E402,F401  (packing, init and flat functions)
