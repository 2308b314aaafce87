"""The pieces every STeP operator shares: stream values, off-chip tensors, the ``Op`` protocol.

An operator is a frozen slotted dataclass holding its input :class:`Value` s (each carries its
:class:`~torch2step.step.types.StreamType`) and its parameters.  Next to its fields it defines

* ``out_types()``  — its shape/type rule from STeP Appendix A (tables 2–6); a violated
  rule raises :class:`~torch2step.errors.StepTypeError` naming the node, the rule and values;
* ``offchip_bytes()`` / ``onchip_bytes()`` — its STeP §4.1 metric formulas (0 by default);
* ``flops()`` — FLOPs of the tile functions it applies (0 by default).

The meaning of an operator on data is in the interpreter's table (:mod:`..interpreter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy as sp

from torch2step.errors import StepTypeError

from .dims import Index, as_dim, dims_equal, fmt_dims
from .types import DTYPE_BYTES, StreamType, TileType

__all__ = ["OffChipTensor", "Op", "Value", "require", "rule_error"]


@dataclass(frozen=True, slots=True)
class Value:
    """A stream in the graph: the output of one node (or a graph input), with its type."""

    name: str
    type: StreamType

    def __str__(self) -> str:
        return f"%{self.name}"


@dataclass(frozen=True, slots=True)
class OffChipTensor:
    """A tensor in off-chip memory (HBM): ``shape`` (sympy sizes) of ``dtype`` elements.

    Off-chip operators view it as a row-major grid of tiles; addresses are tile indices.
    """

    name: str
    shape: tuple[sp.Expr, ...]
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        shape = tuple(as_dim(d) for d in self.shape)
        if len(shape) < 2:
            raise StepTypeError(f"off-chip tensor {self.name}: needs at least two dimensions")
        if self.dtype not in DTYPE_BYTES:
            raise StepTypeError(f"off-chip tensor {self.name}: unknown dtype {self.dtype!r}")
        object.__setattr__(self, "shape", shape)

    def nbytes(self) -> sp.Expr:
        return sp.Mul(*self.shape) * DTYPE_BYTES[self.dtype]

    def tiled_shape(self, tile: TileType, who: str) -> tuple[sp.Expr, ...]:
        """``tiled_in_shape``: the shape in tiles (the last two dims divided by the tile)."""
        if tile.dtype != self.dtype:
            raise StepTypeError(
                f"{who}: tile element type {tile.dtype} differs from tensor {self.name} "
                f"dtype {self.dtype}"
            )
        if not tile.is_static:
            raise StepTypeError(f"{who}: off-chip tiles must be statically sized, got {tile}")
        out = list(self.shape[:-2])
        for d, t in zip(self.shape[-2:], tile.shape):
            if t == 0 or sp.Mod(d, t) != 0:
                raise StepTypeError(
                    f"{who}: tensor {self.name} {fmt_dims(self.shape)} is not a whole number "
                    f"of {fmt_dims(tile.shape)} tiles; pad the tensor or change the tile"
                )
            out.append(d / t)
        return tuple(out)

    def __str__(self) -> str:
        return f"{self.name}: {fmt_dims(self.shape)} {self.dtype}"


class Op:
    """Base class of STeP operators (see the module docstring for the protocol)."""

    __slots__ = ()
    name: str

    def inputs(self) -> tuple[Value, ...]:
        """The input streams, in signature order."""
        raise NotImplementedError

    def num_outputs(self) -> int:
        return 1

    def out_types(self) -> tuple[StreamType, ...]:
        """The shape/type rule: output stream types from the input types and parameters."""
        raise NotImplementedError

    def params(self) -> tuple[tuple[str, Any], ...]:
        """Parameters shown by the printer (in order)."""
        return ()

    def tensors(self) -> tuple[OffChipTensor, ...]:
        """Off-chip tensors the operator reads or writes."""
        return ()

    def optional_outputs(self) -> frozenset[int]:
        """Outputs that may be left unconsumed (acknowledgement / padding / selector streams)."""
        return frozenset()

    def out_names(self) -> tuple[str, ...]:
        n = self.num_outputs()
        return (self.name,) if n == 1 else tuple(f"{self.name}.{k}" for k in range(n))

    def offchip_read_bytes(self) -> sp.Expr:
        """Off-chip bytes read (STeP §4.1: output cardinality x element size)."""
        return sp.Integer(0)

    def offchip_write_bytes(self) -> sp.Expr:
        """Off-chip bytes written."""
        return sp.Integer(0)

    def onchip_bytes(self) -> sp.Expr:
        """On-chip memory requirement in bytes (STeP §4.1)."""
        return sp.Integer(0)

    def flops(self) -> sp.Expr:
        """Floating-point operations of the tile functions applied."""
        return sp.Integer(0)

    @property
    def op_name(self) -> str:
        return type(self).__name__


def rule_error(op: Op, rule: str, **values: object) -> StepTypeError:
    """A :class:`StepTypeError` naming the node, the violated rule and the offending values."""
    shown = "; ".join(f"{k} = {_show(v)}" for k, v in values.items())
    msg = f"{op.op_name} %{op.name}: {rule}"
    return StepTypeError(msg + (f" ({shown})" if shown else ""))


def _show(v: object) -> str:
    if isinstance(v, sp.Basic):
        return sp.sstr(v)
    if isinstance(v, (list, tuple)) and all(isinstance(x, sp.Basic) for x in v):
        return fmt_dims(v)  # type: ignore[arg-type]
    return str(v)


def require(cond: bool, op: Op, rule: str, **values: object) -> None:
    """Raise :func:`rule_error` unless ``cond``."""
    if not cond:
        raise rule_error(op, rule, **values)


def wrap_fn_error(op: Op, err: StepTypeError) -> StepTypeError:
    """Prefix a tile-function rule error with the node that applies the function."""
    return StepTypeError(f"{op.op_name} %{op.name}: {err}")


def prefix_equal(a: StreamType, b: StreamType, n: int) -> bool:
    """True if the outer ``n`` sizes of ``a`` and ``b`` agree (indices matched by position)."""
    if len(a.shape) < n or len(b.shape) < n:
        return False
    ma = {ix: Index(f"_a{p}") for p, ix in enumerate(a.index) if ix is not None}
    mb = {ix: Index(f"_a{p}") for p, ix in enumerate(b.index) if ix is not None}
    return all(dims_equal(a.shape[p].xreplace(ma), b.shape[p].xreplace(mb)) for p in range(n))


def adopt_indices(target: list, src: Sequence, n: int, prefix: str) -> dict:
    """Give ``target``'s outer ``n`` axes the indices ``src`` uses there (in place).

    Returns the renaming to apply to expressions of the source stream.
    """
    mapping = {}
    for p in range(n):
        s = src[p]
        if s is None:
            continue
        t = target[p]
        if t is None:
            t = s if s not in target else Index(f"{prefix}_i{p}")
            target[p] = t
        if t != s:
            mapping[s] = t
    return mapping
