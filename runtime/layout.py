"""HBM layout: where each tensor lives and how a region's bytes spread over the channels.

Tensors are placed one after another in HBM, in the order the :class:`~lowering.isa.ProgramSet`
declares them, each starting on a multiple of the interleave *round* (``interleave_bytes x
channels``), and every tensor is sliced evenly over all channels by address interleaving: byte
address ``a`` belongs to channel ``(a // interleave_bytes) % channels``.  This is the placement of
ELK's evaluation (ELK §5: "we evenly slice each tensor across all HBM modules to balance
traffic, and sequentially place tensors in HBM").

A region (an n-d box) of a row-major tensor is a set of contiguous byte *runs*; the bytes each
channel serves are counted exactly with ``F(x, c)``, the number of bytes below address ``x`` that
map to channel ``c``.  The split depends only on the tensor's shape and element size, the region's extents and its
start address modulo the round, so it is cached under that key (tiled loads repeat a handful of
keys, and equal layers' tensors share theirs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import mul

import numpy as np

from hwmodel.chip import HbmSpec
from lowering.isa import DTYPE_BYTES, TensorDecl
from runtime.errors import SimulationError

__all__ = ["TensorInfo", "HbmLayout", "INT_DTYPES", "numpy_dtype"]

#: Dtypes whose values are real in both modes (routing tables, lengths, selectors).
INT_DTYPES = frozenset({"int32", "int64", "int8", "bool"})

_NP_DTYPES: Mapping[str, type] = {
    "bf16": np.float32,
    "fp16": np.float32,
    "fp32": np.float32,
    "int32": np.int32,
    "int64": np.int64,
    "int8": np.int8,
    "bool": np.bool_,
}


def numpy_dtype(dtype: str) -> type:
    """The numpy type functional mode stores ``dtype`` in (bf16/fp16 compute in float32)."""
    return _NP_DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor's place in HBM: ``base`` byte address, element ``strides`` (row-major)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    elem_bytes: int
    base: int
    nbytes: int
    strides: tuple[int, ...]
    #: an integer tensor: carries real values in timing mode too (read per Load and Store,
    #: so a field rather than a property)
    is_int: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_int", self.dtype in INT_DTYPES)


class HbmLayout:
    """Tensor placement plus the per-channel byte split of any region (ELK §5)."""

    __slots__ = ("spec", "tensors", "round", "_split_cache", "total_bytes")

    def __init__(self, spec: HbmSpec, decls: Sequence[TensorDecl]) -> None:
        if spec.channels < 1 or spec.interleave_bytes < 1:
            raise SimulationError(
                f"HBM needs at least one channel and a positive interleave_bytes, got "
                f"channels={spec.channels}, interleave_bytes={spec.interleave_bytes}"
            )
        self.spec = spec
        self.round = spec.interleave_bytes * spec.channels
        self.tensors: dict[str, TensorInfo] = {}
        self._split_cache: dict[tuple, tuple[tuple[int, int], ...]] = {}
        addr = 0
        for d in decls:
            if d.name in self.tensors:
                raise SimulationError(f"tensor {d.name!r} is declared twice; rename one of them")
            if d.dtype not in DTYPE_BYTES:
                raise SimulationError(
                    f"tensor {d.name!r} has unknown dtype {d.dtype!r}; use one of "
                    f"{', '.join(sorted(DTYPE_BYTES))}"
                )
            eb = DTYPE_BYTES[d.dtype]
            nbytes = math.prod(d.shape) * eb
            strides = tuple(math.prod(d.shape[i + 1 :]) for i in range(len(d.shape)))
            self.tensors[d.name] = TensorInfo(
                d.name, tuple(d.shape), d.dtype, eb, addr, nbytes, strides
            )
            addr += -(-nbytes // self.round) * self.round
        self.total_bytes = addr
        if addr > spec.capacity_bytes:
            raise SimulationError(
                f"the declared tensors need {addr} bytes of HBM but the chip has "
                f"{spec.capacity_bytes}; use a chip with more HBM or fewer/smaller tensors"
            )

    def split(
        self, info: TensorInfo, starts: tuple[int, ...], extents: tuple[int, ...]
    ) -> tuple[tuple[int, int], ...]:
        """``(channel, bytes)`` pairs (bytes > 0, channel order) a region occupies."""
        eb = info.elem_bytes
        off = info.base + eb * sum(map(mul, starts, info.strides))
        # what the split depends on (:meth:`_compute_split`): the tensor's shape and element
        # size, the extents and the start within the interleave round, not which tensor it is
        # (the same region of equal layers' weights is one entry)
        key = (info.shape, eb, extents, off % self.round)
        hit = self._split_cache.get(key)
        if hit is None:
            hit = self._compute_split(info, off, extents)
            self._split_cache[key] = hit
        return hit

    def element_channel(self, info: TensorInfo, index: tuple[int, ...]) -> int:
        """The channel holding one element."""
        off = info.base + info.elem_bytes * sum(i * st for i, st in zip(index, info.strides))
        return (off // self.spec.interleave_bytes) % self.spec.channels

    def _compute_split(
        self, info: TensorInfo, off: int, extents: tuple[int, ...]
    ) -> tuple[tuple[int, int], ...]:
        if any(e == 0 for e in extents):
            return ()
        shape, eb = info.shape, info.elem_bytes
        # k: the innermost dimension the region does not cover fully; runs are contiguous from
        # there inwards.
        k = 0
        for j in range(len(shape) - 1, -1, -1):
            if extents[j] != shape[j]:
                k = j
                break
        run = extents[k] * math.prod(shape[k + 1 :]) * eb if shape else eb
        if k == 0:  # one contiguous run: in closed form (the common case; numpy costs more)
            return self._run_split(off, run)
        starts = np.zeros(1, dtype=np.int64)
        for j in range(k):
            step = info.strides[j] * eb
            starts = (starts[:, None] + np.arange(extents[j], dtype=np.int64) * step).reshape(-1)
        starts += off
        chans = self.spec.channels
        gran = self.spec.interleave_bytes
        lo = np.arange(chans, dtype=np.int64) * gran
        total = np.zeros(chans, dtype=np.int64)
        for i in range(0, len(starts), 4096):  # bound the temporary (runs x channels) arrays
            a = starts[i : i + 4096]
            total += (self._below(a + run, lo) - self._below(a, lo)).sum(axis=0)
        return tuple((c, int(b)) for c, b in enumerate(total) if b > 0)

    def _run_split(self, off: int, run: int) -> tuple[tuple[int, int], ...]:
        """:meth:`_compute_split` of the one run of ``run`` bytes at address ``off``: per
        channel ``F(off + run, c) - F(off, c)`` (:meth:`_below`) in integer arithmetic."""
        gran, rnd = self.spec.interleave_bytes, self.round
        qa, ra = divmod(off, rnd)
        qb, rb = divmod(off + run, rnd)
        full = (qb - qa) * gran
        out = []
        lo = 0
        for c in range(self.spec.channels):
            b = full + min(max(rb - lo, 0), gran) - min(max(ra - lo, 0), gran)
            if b > 0:
                out.append((c, b))
            lo += gran
        return tuple(out)

    def _below(self, x: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """``F(x, c)``: bytes below address ``x`` that map to channel ``c`` (runs x channels)."""
        gran = self.spec.interleave_bytes
        full = (x // self.round)[:, None] * gran
        part = np.clip((x % self.round)[:, None] - lo[None, :], 0, gran)
        return full + part
