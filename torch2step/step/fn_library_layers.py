"""Tile functions the layer lowering applies (registered on import).

Map:    rmsnorm(eps) (row RMSNorm times a weight row), layernorm / layernorm_w / layernorm_b /
        layernorm_wb (eps) (row LayerNorm, then a gain and / or bias row), rotary(theta,
        rotary_dim) (rotate-half RoPE of a row at an integer position), softmax_row, topk_route(k, softmax_first,
        normalize) (router: logits row -> (weights, expert ids)), tile_reshape(rows, cols),
        unary elementwise ``neg sigmoid gelu gelu_tanh erf tanh rsqrt sqrt reciprocal square
        cast``, scalar forms
        ``add_scalar mul_scalar pow_scalar`` (``value``), ``where`` (cond, a, b),
        reduce_row(fn) (``sum``/``mean``/``max`` of each row), slice_cols(start, end).
Update: retile_col (append a tile's columns to the accumulator: the dynamic-width tile of a
        whole output row block, the column counterpart of STeP Fig. 2 "RetileRow").

FLOP counts follow the convention of the built-in library: one per element per elementary
operation (STeP §4.1 counts matmul FLOPs; the rest is reported for completeness).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import sympy as sp
import torch

from torch2step.errors import StepTypeError

from .dims import as_dim
from .fn_library import _eq, _tile, gelu, gelu_tanh
from .functions import Fn, FnSpec, register_fn
from .types import DataType, TileType, TupleType

__all__ = ["LAYERNORM_FNS", "layernorm_flops"]


def _elems(t: TileType) -> sp.Expr:
    return t.shape[0] * t.shape[1]


def _same(f: Fn, args: tuple[DataType, ...]) -> TileType:
    return _tile(f, args[0])


def _per_elem(n: int) -> Any:
    return lambda f, args: n * _elems(_tile(f, args[0]))


# ---------------------------------------------------------------- retile_col


def _retile_col_rule(f: Fn, args: tuple[DataType, ...], acc: DataType) -> DataType:
    t, a = _tile(f, args[0], "tile"), _tile(f, acc, "accumulator")
    _eq(f, t.shape[0], a.shape[0], "tile and accumulator rows")
    return TileType((a.shape[0], a.shape[1] + t.shape[1]), a.dtype)


def _retile_col_accum(
    f: Fn, args: tuple[DataType, ...], init: DataType, count: sp.Expr
) -> DataType:
    t, a = _tile(f, args[0], "tile"), _tile(f, init, "accumulator")
    _eq(f, t.shape[0], a.shape[0], "tile and accumulator rows")
    return TileType((a.shape[0], a.shape[1] + count * t.shape[1]), a.dtype)


register_fn(
    FnSpec(
        "retile_col",
        "update",
        1,
        _retile_col_rule,
        lambda f, t, acc: np.concatenate([acc, t], axis=1),
        accum_rule=_retile_col_accum,
        doc="append a tile's columns to the accumulator (a whole output row block)",
    )
)

# ---------------------------------------------------------------- row operators


def _rmsnorm_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x, w = _tile(f, args[0], "x"), _tile(f, args[1], "weight")
    _eq(f, x.shape[1], w.shape[1], "x and weight cols")
    return x


def _rmsnorm(f: Fn, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    eps = float(f.get("eps", 1e-6))
    var = np.mean(x.astype(np.float32) ** 2, axis=1, keepdims=True)
    return (x / np.sqrt(var + eps) * w).astype(x.dtype, copy=False)


register_fn(
    FnSpec(
        "rmsnorm",
        "map",
        2,
        _rmsnorm_rule,
        _rmsnorm,
        flops=_per_elem(4),
        doc="x * rsqrt(mean(x^2) + eps) * w per row, rmsnorm(eps=)",
    )
)


#: LayerNorm tile functions by the rows they apply after normalising: none, the gain, the bias,
#: both (one function per argument count; ``layernorm_wb(eps=)`` takes ``(x, w, b)``).
LAYERNORM_FNS = {
    (False, False): "layernorm",
    (True, False): "layernorm_w",
    (False, True): "layernorm_b",
    (True, True): "layernorm_wb",
}


def layernorm_flops(weight: bool, bias: bool) -> int:
    """FLOPs per element of a row LayerNorm (Ba et al., "Layer Normalization", §3): the mean's
    sum, x - mu, its square, the variance's sum, the scaling by 1/sigma (the per-row rsqrt is
    not counted, as rmsnorm's), then the gain and the bias when applied.  The tile functions
    and the kernel-by-kernel vector operator (:mod:`torch2step.kernel.graph`) count this."""
    return 5 + int(weight) + int(bias)


def _layernorm_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x = _tile(f, args[0], "x")
    for a in args[1:]:
        _eq(f, x.shape[1], _tile(f, a, "weight/bias").shape[1], "x and weight/bias cols")
    return x


def _layernorm(f: Fn, x: np.ndarray, *wb: np.ndarray) -> np.ndarray:
    """Ba et al., "Layer Normalization", §3, per row: ``(x - mu) / sqrt(sigma^2 + eps)``
    (biased variance, fp32), times the gain row and plus the bias row when given."""
    eps = float(f.get("eps", 1e-5))
    x32 = x.astype(np.float32)
    mu = np.mean(x32, axis=1, keepdims=True)
    var = np.mean((x32 - mu) ** 2, axis=1, keepdims=True)
    y = (x32 - mu) / np.sqrt(var + eps)
    rows = list(wb)
    if f.name in ("layernorm_w", "layernorm_wb"):
        y = y * rows.pop(0)
    if f.name in ("layernorm_b", "layernorm_wb"):
        y = y + rows.pop(0)
    return y.astype(x.dtype, copy=False)


for (_w, _b), _name in LAYERNORM_FNS.items():
    register_fn(
        FnSpec(
            _name,
            "map",
            1 + int(_w) + int(_b),
            _layernorm_rule,
            _layernorm,
            flops=_per_elem(layernorm_flops(_w, _b)),
            doc=f"(x - mean) * rsqrt(var + eps) per row{' * w' if _w else ''}"
            f"{' + b' if _b else ''}, {_name}(eps=)",
        )
    )


def _rotary_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x, pos = _tile(f, args[0], "x"), _tile(f, args[1], "position")
    if pos.dtype not in ("int32", "int64"):
        raise StepTypeError(f"function {f}: positions must be integers, got {pos}")
    if pos.shape[0] != 1:  # one position per row, or one for all rows of the tile
        _eq(f, x.shape[0], pos.shape[0], "rows of x and positions")
    return x


def rope_inv_freq(
    theta: float, rotary_dim: int, table_dtype: str = "float32", given: Sequence[float] = ()
) -> torch.Tensor:
    """HF's default RoPE table ``theta ** -(arange(0, d, 2) / d)`` in fp32, rounded to
    ``table_dtype`` (the dtype the module holds its ``inv_freq`` buffer in) and back; a
    ``given`` table (a scaled RoPE's, as the module holds it) as it is."""
    if len(given):
        return torch.tensor([float(v) for v in given], dtype=torch.float32)
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv = 1.0 / (theta**exps)
    return inv.to(getattr(torch, table_dtype)).float()


def _rotary(f: Fn, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (HF Llama/Qwen3): ``x * cos + rotate_half(x) * sin`` on the first
    ``rotary_dim`` features with inverse frequencies ``theta ** (-2i / rotary_dim)`` (held in
    ``table_dtype``)."""
    theta, rd = float(f.get("theta", 10000.0)), int(f.get("rotary_dim", x.shape[1]))
    table = f.get("inv_freq", ())
    inv = rope_inv_freq(theta, rd, str(f.get("table_dtype", "float32")), table).numpy()
    ang = pos.astype(np.float32).reshape(-1, 1) * inv.reshape(1, -1)
    emb = np.concatenate([ang, ang], axis=1)
    cos, sin = np.cos(emb), np.sin(emb)
    xr = x[:, :rd]
    half = rd // 2
    rot = np.concatenate([-xr[:, half:], xr[:, :half]], axis=1)
    out = x.copy()
    out[:, :rd] = xr * cos + rot * sin
    return out.astype(x.dtype, copy=False)


register_fn(
    FnSpec(
        "rotary",
        "map",
        2,
        _rotary_rule,
        _rotary,
        flops=_per_elem(3),
        doc="rotate-half RoPE of each row at its integer position (one position: all rows), "
        "rotary(theta=, rotary_dim=[, inv_freq=])",
    )
)


def _softmax(f: Fn, x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1, keepdims=True)
    e = np.exp(x - m)
    return (e / np.sum(e, axis=1, keepdims=True)).astype(x.dtype, copy=False)


register_fn(
    FnSpec(
        "softmax_row",
        "map",
        1,
        _same,
        _softmax,
        flops=_per_elem(4),
        doc="softmax of each row",
    )
)


def _topk_rule(f: Fn, args: tuple[DataType, ...]) -> TupleType:
    x = _tile(f, args[0], "logits")
    k = as_dim(f.get("k", 1))
    return TupleType((TileType((x.shape[0], k), x.dtype), TileType((x.shape[0], k), "int64")))


def _topk(f: Fn, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Router of Mixtral / Qwen3 (``softmax_first``) or top-k-then-softmax; ties resolve to
    the lower expert id, as ``torch.topk`` does on CPU."""
    k = int(f.get("k", 1))
    probs = _softmax(f, x) if f.get("softmax_first", True) else x
    idx = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, idx, axis=1)
    if not f.get("softmax_first", True):
        w = _softmax(f, w)
    elif f.get("normalize", True):
        w = w / np.sum(w, axis=1, keepdims=True)
    return w.astype(x.dtype, copy=False), idx.astype(np.int64)


register_fn(
    FnSpec(
        "topk_route",
        "map",
        1,
        _topk_rule,
        _topk,
        flops=_per_elem(6),
        doc="router row: logits -> (weights [r,k], expert ids [r,k]), topk_route(k=, ...)",
    )
)


def _reshape_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x = _tile(f, args[0])
    r, c = as_dim(f.get("rows", 1)), as_dim(f.get("cols", 1))
    if sp.simplify(r * c - _elems(x)) != 0:
        raise StepTypeError(f"function {f}: cannot view {x} as [{r}, {c}]")
    return TileType((r, c), x.dtype)


register_fn(
    FnSpec(
        "tile_reshape",
        "map",
        1,
        _reshape_rule,
        lambda f, x: x.reshape(int(f.get("rows", 1)), int(f.get("cols", 1))),
        doc="row-major view of a tile as [rows, cols]",
    )
)


def _erf(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf

    return erf(x).astype(x.dtype, copy=False)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x))).astype(x.dtype, copy=False)


def _inverse(x: np.ndarray, root: bool) -> np.ndarray:
    """``1/sqrt(x)`` or ``1/x`` with PyTorch's semantics: a zero gives ``inf`` silently."""
    with np.errstate(divide="ignore"):
        return (1.0 / (np.sqrt(x) if root else x)).astype(x.dtype, copy=False)


_UNARY: dict[str, tuple[Any, int]] = {
    "neg": (lambda f, x: -x, 1),
    "sigmoid": (lambda f, x: _sigmoid(x), 4),
    "erf": (lambda f, x: _erf(x), 8),
    "tanh": (lambda f, x: np.tanh(x), 4),
    "gelu": (lambda f, x: gelu(x), 8),
    # the tanh approximation, 9 per element as the gated gelu_tanh_mul counts it (10 there)
    "gelu_tanh": (lambda f, x: gelu_tanh(x), 9),
    "rsqrt": (lambda f, x: _inverse(x, True), 2),
    "sqrt": (lambda f, x: np.sqrt(x), 1),
    "reciprocal": (lambda f, x: _inverse(x, False), 1),
    "square": (lambda f, x: x * x, 1),
    "add_scalar": (lambda f, x: (x + float(f.get("value", 0.0))).astype(x.dtype), 1),
    "mul_scalar": (lambda f, x: (x * float(f.get("value", 1.0))).astype(x.dtype), 1),
    "pow_scalar": (lambda f, x: np.power(x, float(f.get("value", 1.0))).astype(x.dtype), 2),
}
for _name, (_impl, _per) in _UNARY.items():
    register_fn(
        FnSpec(_name, "map", 1, _same, _impl, flops=_per_elem(_per), doc=f"elementwise {_name}")
    )


def _cast_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x = _tile(f, args[0])
    return TileType(x.shape, str(f.get("dtype", x.dtype)))


def _cast(f: Fn, x: np.ndarray) -> np.ndarray:
    from .fn_library import np_dtype

    return x.astype(np_dtype(str(f.get("dtype", "fp32"))))


register_fn(FnSpec("cast", "map", 1, _cast_rule, _cast, doc="convert elements, cast(dtype=)"))


def _where_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    c, a, b = (_tile(f, t) for t in args)
    out = []
    for dims in zip(c.shape, a.shape, b.shape):
        big = [d for d in dims if d != 1]
        out.append(big[0] if big else sp.Integer(1))
    return TileType(tuple(out), a.dtype)


register_fn(
    FnSpec(
        "where",
        "map",
        3,
        _where_rule,
        lambda f, c, a, b: np.where(c.astype(bool), a, b).astype(a.dtype, copy=False),
        flops=lambda f, args: _elems(_where_rule(f, args)),
        doc="cond ? a : b with [m,1]/[1,n] broadcasting",
    )
)

_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max}


def _reduce_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x = _tile(f, args[0])
    if f.get("fn", "sum") not in _REDUCE:
        raise StepTypeError(f"function {f}: fn must be one of {sorted(_REDUCE)}")
    return TileType((x.shape[0], 1), x.dtype)


register_fn(
    FnSpec(
        "reduce_row",
        "map",
        1,
        _reduce_rule,
        lambda f, x: _REDUCE[str(f.get("fn", "sum"))](x, axis=1, keepdims=True).astype(x.dtype),
        flops=_per_elem(1),
        doc="sum / mean / max of each row, reduce_row(fn=)",
    )
)


def _slice_rule(f: Fn, args: tuple[DataType, ...]) -> TileType:
    x = _tile(f, args[0])
    a, b = as_dim(f.get("start", 0)), as_dim(f.get("end", x.shape[1]))
    return TileType((x.shape[0], b - a), x.dtype)


register_fn(
    FnSpec(
        "slice_cols",
        "map",
        1,
        _slice_rule,
        lambda f, x: np.ascontiguousarray(x[:, int(f.get("start", 0)) : int(f.get("end", 0))]),
        doc="columns start..end of a tile, slice_cols(start=, end=)",
    )
)
