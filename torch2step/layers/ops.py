"""Layer-graph operations: the small typed vocabulary captured models are raised into.

Each operation is a frozen dataclass holding its attributes; its inputs are value names on the
:class:`~torch2step.layers.graph.Node`.  The input order each op expects is in its docstring and
``infer`` is its shape rule (shapes are tuples of ``int | sympy.Expr``).  What each op computes is
defined once, in :mod:`torch2step.layers.evaluate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import sympy

from torch2step.errors import FrontendError

__all__ = [
    "Dim",
    "TensorType",
    "LayerOp",
    "Linear",
    "MatMul",
    "Elementwise",
    "RMSNorm",
    "LayerNorm",
    "Softmax",
    "Rotary",
    "TopKRouting",
    "MoEExperts",
    "Attention",
    "Concat",
    "Gather",
    "Reshape",
    "Permute",
    "Slice",
    "Reduce",
    "Cast",
    "Arange",
    "ELEMENTWISE_ARITY",
]

Dim = int | sympy.Expr


@dataclass(frozen=True, slots=True)
class TensorType:
    """Shape (``int`` or sympy expression per dimension) and dtype name (``"fp32"``, ``"bf16"``,
    ``"int64"``, ``"bool"``)."""

    shape: tuple[Dim, ...]
    dtype: str = "fp32"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


def _same(a: Dim, b: Dim) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def _broadcast(op: str, shapes: Sequence[tuple[Dim, ...]]) -> tuple[Dim, ...]:
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for axis in range(rank):
        dims = [s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0]
        chosen: Dim = 1
        for d in dims:
            if d == 1:
                continue
            if chosen == 1:
                chosen = d
            elif not _same(chosen, d):
                raise FrontendError(f"{op}: shapes {list(map(list, shapes))} do not broadcast")
        out.append(chosen)
    return tuple(out)


class LayerOp:
    """Base of every layer operation: ``infer(in_types) -> out_types``."""

    num_outputs: ClassVar[int] = 1

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        raise NotImplementedError(type(self).__name__)


@dataclass(frozen=True, slots=True)
class Linear(LayerOp):
    """``y = x @ w.T (+ b)``; inputs ``(x[..., in], w[out, in][, b[out]])``."""

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x, w = ins[0], ins[1]
        if w.rank != 2 or not _same(x.shape[-1], w.shape[1]):
            raise FrontendError(
                f"Linear: x {x} and weight {w} do not match (x[..., in], w[out, in])"
            )
        return (TensorType((*x.shape[:-1], w.shape[0]), x.dtype),)


@dataclass(frozen=True, slots=True)
class MatMul(LayerOp):
    """Batched ``a @ b`` with broadcasting of the batch dimensions; inputs ``(a, b)``."""

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        a, b = ins
        if a.rank < 2 or b.rank < 2:
            raise FrontendError(
                f"MatMul: operands {a} and {b} must have rank >= 2 (a 1-D operand is a [1, K] "
                "row or a [K, 1] column: reshape it first)"
            )
        if not _same(a.shape[-1], b.shape[-2]):
            raise FrontendError(f"MatMul: inner dimensions of {a} and {b} differ")
        batch = _broadcast("MatMul", [a.shape[:-2], b.shape[:-2]])
        return (TensorType((*batch, a.shape[-2], b.shape[-1]), a.dtype),)


#: Elementwise function name -> number of tensor inputs.  ``scalar`` attributes supply constants.
ELEMENTWISE_ARITY: dict[str, int] = {
    "add": 2,
    "sub": 2,
    "mul": 2,
    "div": 2,
    "maximum": 2,
    "where": 3,
    "neg": 1,
    "exp": 1,
    "silu": 1,
    "gelu": 1,
    "gelu_tanh": 1,
    "sigmoid": 1,
    "erf": 1,
    "tanh": 1,
    "relu": 1,
    "rsqrt": 1,
    "sqrt": 1,
    "reciprocal": 1,
    "square": 1,
    "add_scalar": 1,
    "mul_scalar": 1,
    "pow_scalar": 1,
}


@dataclass(frozen=True, slots=True)
class Elementwise(LayerOp):
    """Elementwise ``fn`` over broadcast inputs (see :data:`ELEMENTWISE_ARITY`); ``scalar`` is the
    constant of the ``*_scalar`` forms."""

    fn: str
    scalar: float = 0.0

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        arity = ELEMENTWISE_ARITY.get(self.fn)
        if arity is None:
            raise FrontendError(f"Elementwise: unknown function {self.fn!r}")
        if len(ins) != arity:
            raise FrontendError(f"Elementwise {self.fn}: expects {arity} inputs, got {len(ins)}")
        dtype = ins[-1].dtype if self.fn == "where" else ins[0].dtype
        return (TensorType(_broadcast(self.fn, [t.shape for t in ins]), dtype),)


@dataclass(frozen=True, slots=True)
class RMSNorm(LayerOp):
    """``x * rsqrt(mean(x^2, -1) + eps) * w`` (computed in fp32); inputs ``(x, w[last])``."""

    eps: float

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x, w = ins
        if w.rank != 1 or not _same(w.shape[0], x.shape[-1]):
            raise FrontendError(f"RMSNorm: weight {w} must be 1-D of x's last dim ({x})")
        return (x,)


@dataclass(frozen=True, slots=True)
class LayerNorm(LayerOp):
    """Layer normalisation over the last dimension (Ba et al., "Layer Normalization", §3):
    ``(x - mean(x, -1)) * rsqrt(var(x, -1) + eps)`` (biased variance, computed in fp32), times
    a gain ``w`` when ``weight`` and plus a bias ``b`` when ``bias``; inputs ``(x[, w][, b])``,
    ``w`` and ``b`` 1-D of x's last dim."""

    eps: float
    weight: bool = True
    bias: bool = True

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        want = 1 + int(self.weight) + int(self.bias)
        if len(ins) != want:
            raise FrontendError(f"{self}: expects {want} inputs (x, weight, bias), got {len(ins)}")
        x = ins[0]
        names = [n for n, on in (("weight", self.weight), ("bias", self.bias)) if on]
        for name, t in zip(names, ins[1:]):
            if t.rank != 1 or not _same(t.shape[0], x.shape[-1]):
                raise FrontendError(f"LayerNorm: {name} {t} must be 1-D of x's last dim ({x})")
        return (x,)


@dataclass(frozen=True, slots=True)
class Softmax(LayerOp):
    """Softmax over ``dim``; inputs ``(x,)``."""

    dim: int = -1

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        return (ins[0],)


@dataclass(frozen=True, slots=True)
class Rotary(LayerOp):
    """Rotary position embedding (rotate-half form, as HF Llama/Qwen3) of the first
    ``rotary_dim`` features with base ``theta``; inputs ``(x[B, H, S, D], positions[B, S])``
    (integer positions).  ``table_dtype``: the dtype the module holds its inverse-frequency
    table in (a bf16 model's ``inv_freq`` buffer is rounded to bf16; the angles are then
    computed in fp32 from the rounded table, as HF's rotary embedding does).  ``inv_freq``:
    the module's own inverse frequencies when they are not ``theta ** (-2i / rotary_dim)`` (a
    scaled RoPE such as Llama 3.1's "llama3"), taken as given; empty: the default table."""

    theta: float
    rotary_dim: int
    table_dtype: str = "float32"
    inv_freq: tuple[float, ...] = ()

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x, pos = ins
        if x.rank != 4 or pos.rank != 2:
            raise FrontendError(
                f"Rotary: expects x[B, H, S, D] and positions[B, S]; got {x}, {pos}"
            )
        return (x,)


@dataclass(frozen=True, slots=True)
class TopKRouting(LayerOp):
    """MoE router: from ``logits[T, E]`` to ``(weights[T, k], experts[T, k])``.

    ``softmax_first``: softmax over all experts then top-k (Mixtral, Qwen3); otherwise top-k of
    the logits then softmax over the k.  ``normalize``: renormalise the k weights to sum 1."""

    k: int
    softmax_first: bool = True
    normalize: bool = True
    num_outputs: ClassVar[int] = 2

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        (logits,) = ins
        if logits.rank != 2:
            raise FrontendError(f"TopKRouting: logits must be [tokens, experts], got {logits}")
        t = logits.shape[0]
        return (TensorType((t, self.k), logits.dtype), TensorType((t, self.k), "int64"))


@dataclass(frozen=True, slots=True)
class MoEExperts(LayerOp):
    """Routed experts: ``y[t] = sum_j w[t, j] * E_{e[t, j]}(x[t])`` with, when ``gated``
    (SwiGLU, GeGLU, ReGLU), ``E_e(x) = down_e(act(gate_e x + bg_e) * (up_e x + bu_e)) + bd_e``
    and otherwise (a plain two-matrix MLP) ``E_e(x) = down_e(act(up_e x + bu_e)) + bd_e``.

    Inputs ``(x[T, H], weights[T, k], experts[T, k], [w_gate[E, I, H],] w_up[E, I, H],
    w_down[E, H, I])``, then with ``bias`` ``([b_gate[E, I],] b_up[E, I], b_down[E, H])``
    (the bracketed ones only when ``gated``); see :meth:`roles`."""

    num_experts: int
    top_k: int
    activation: str = "silu"
    gated: bool = True
    bias: bool = False

    def roles(self) -> tuple[str, ...]:
        """The names of the inputs, in order."""
        w = ("w_gate", "w_up", "w_down") if self.gated else ("w_up", "w_down")
        b = (
            (("b_gate", "b_up", "b_down") if self.gated else ("b_up", "b_down"))
            if self.bias
            else ()
        )
        return ("x", "weights", "experts", *w, *b)

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        roles = self.roles()
        if len(ins) != len(roles):
            raise FrontendError(
                f"MoEExperts: expected {len(roles)} inputs ({', '.join(roles)}), got {len(ins)}"
            )
        t = dict(zip(roles, ins))
        x, up, down = t["x"], t["w_up"], t["w_down"]
        for name in ("w_gate", "w_up"):
            g = t.get(name)
            if g is not None and (g.rank != 3 or not _same(g.shape[0], self.num_experts)):
                raise FrontendError(
                    f"MoEExperts: {name} must be [E={self.num_experts}, I, H], got {g}"
                )
        if not _same(up.shape[2], x.shape[-1]) or not _same(down.shape[1], x.shape[-1]):
            raise FrontendError(
                f"MoEExperts: hidden sizes of x {x}, w_up {up}, w_down {down} differ"
            )
        return (x,)


@dataclass(frozen=True, slots=True)
class Attention(LayerOp):
    """Grouped-query attention ``softmax(q k^T * scale + mask) v``; inputs ``(q[B, Hq, S, D],
    k[B, Hkv, L, D], v[B, Hkv, L, D][, kv_lengths[B]])``, Hq a multiple of Hkv (query head h uses
    KV head ``h // (Hq // Hkv)``).

    ``causal``: query i (of S, aligned to the end of the L keys) sees keys ``j <= L - S + i``.
    With ``kv_lengths`` (ragged KV caches padded to L): key j of request b is visible iff
    ``j < kv_lengths[b]`` or ``j >= L - S`` (its cached prefix plus the new tokens)."""

    num_q_heads: int
    num_kv_heads: int
    scale: float
    causal: bool = False

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        q, k, v = ins[:3]
        if q.rank != 4 or k.rank != 4 or v.rank != 4:
            raise FrontendError(f"Attention: q, k, v must be [B, H, S, D]; got {q}, {k}, {v}")
        if self.num_q_heads % self.num_kv_heads:
            raise FrontendError(
                f"Attention: {self.num_q_heads} query heads is not a multiple of {self.num_kv_heads} KV heads"
            )
        return (TensorType((*q.shape[:3], v.shape[3]), q.dtype),)


@dataclass(frozen=True, slots=True)
class Concat(LayerOp):
    """Concatenate the inputs along ``dim``."""

    dim: int

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        base = ins[0].shape
        d = self.dim % len(base)
        total = sympy.Add(*[sympy.sympify(t.shape[d]) for t in ins])
        size: Dim = int(total) if total.is_Integer else total
        return (TensorType((*base[:d], size, *base[d + 1 :]), ins[0].dtype),)


@dataclass(frozen=True, slots=True)
class Gather(LayerOp):
    """``x.index_select(dim, index)``, a negative index counting from the end (``index + size``,
    as ONNX ``Gather`` and PyTorch's ``x[..., index]``); inputs ``(x, index[n])``."""

    dim: int

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x, idx = ins
        d = self.dim % x.rank
        return (TensorType((*x.shape[:d], idx.shape[0], *x.shape[d + 1 :]), x.dtype),)


@dataclass(frozen=True, slots=True)
class Reshape(LayerOp):
    """View as ``shape`` (entries may be sympy expressions of the graph's dynamic dims)."""

    shape: tuple[Dim, ...]

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        return (TensorType(self.shape, ins[0].dtype),)


@dataclass(frozen=True, slots=True)
class Permute(LayerOp):
    """Permute dimensions (``transpose`` is a two-axis permutation)."""

    dims: tuple[int, ...]

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x = ins[0]
        return (TensorType(tuple(x.shape[d] for d in self.dims), x.dtype),)


@dataclass(frozen=True, slots=True)
class Slice(LayerOp):
    """``x[..., start:end, ...]`` along ``dim`` (step 1)."""

    dim: int
    start: Dim
    end: Dim

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x = ins[0]
        d = self.dim % x.rank
        return (TensorType((*x.shape[:d], self.end - self.start, *x.shape[d + 1 :]), x.dtype),)


@dataclass(frozen=True, slots=True)
class Reduce(LayerOp):
    """``sum``/``mean``/``max`` over ``dims``."""

    fn: str
    dims: tuple[int, ...]
    keepdim: bool = False

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        x = ins[0]
        axes = {d % x.rank for d in self.dims}
        shape = tuple(
            (1 if i in axes else s) for i, s in enumerate(x.shape) if self.keepdim or i not in axes
        )
        return (TensorType(shape, x.dtype),)


@dataclass(frozen=True, slots=True)
class Cast(LayerOp):
    """Change dtype."""

    dtype: str

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        return (TensorType(ins[0].shape, self.dtype),)


@dataclass(frozen=True, slots=True)
class Arange(LayerOp):
    """``arange(start, end)`` as int64 ``[end - start]``; no inputs.  ``start``/``end`` may be
    sympy expressions of the graph's dynamic dims, e.g. the decode positions ``P .. P + S`` of
    new tokens after a KV cache of length ``P`` (the integer positions :class:`Rotary` reads)."""

    start: Dim
    end: Dim

    def infer(self, ins: Sequence[TensorType]) -> tuple[TensorType, ...]:
        if ins:
            raise FrontendError(f"Arange: takes no inputs, got {len(ins)}")
        size = sympy.sympify(self.end) - sympy.sympify(self.start)
        return (TensorType((int(size) if size.is_Integer else size,), "int64"),)
