"""Stand-in values for a layer graph whose weights (or example inputs) are shapes only.

Timing a STeP program needs the values that steer it — the router's choices, the KV lengths —
but not the values of the large weight matrices: the same tiles move and the same FLOPs run
whatever numbers they hold (STeP, arXiv 2511.07776, §4.1: traffic, compute and on-chip memory
are functions of shapes and of the dynamic sizes).  A ``meta`` tensor is therefore replaced by

- random numbers when it is small (routers, norms, activations: what decides the routing), and
- lazily allocated zeros when it is large (``numpy.zeros`` maps untouched pages to the shared
  zero page, so a 5 GB expert stack reads as zeros without 5 GB of memory).

Functional results computed on stand-ins are meaningless; only timing is reported from them.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "standin",
    "standin_params",
    "standin_inputs",
    "is_zero_standin",
    "concat_zeros",
    "SMALL",
]

#: Tensors of at most this many elements get random values; larger ones lazy zeros.
SMALL = 1 << 20


def standin(t: torch.Tensor, seed: int, small: int = SMALL) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape for a ``meta`` tensor ``t`` (``t`` itself otherwise)."""
    if not t.is_meta:
        return t
    shape = tuple(int(d) for d in t.shape)
    if is_zero_standin(t, small):
        return torch.from_numpy(
            np.zeros(shape, np.float32 if t.dtype.is_floating_point else np.int64)
        )
    gen = torch.Generator().manual_seed(seed)
    scale = shape[-1] ** -0.5 if shape else 1.0
    return torch.randn(shape, generator=gen) * scale


def is_zero_standin(t: torch.Tensor, small: int = SMALL) -> bool:
    """Whether :func:`standin` gives ``t`` lazily allocated zeros (a large or integer ``meta``
    tensor)."""
    return t.is_meta and (not t.dtype.is_floating_point or t.numel() > small)


def concat_zeros(parts: Sequence[torch.Tensor], zero: Sequence[bool], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)`` where the parts flagged in ``zero`` hold only zeros: the
    result is lazily allocated zeros (:func:`_zeros`) with only the other parts copied in, so
    a KV cache stand-in of a gigabyte followed by one new row costs the row, not a gigabyte
    copied (the values are the same: every element of a zero part is ``+0.0``)."""
    dtype = parts[0].dtype
    if any(p.dtype != dtype for p in parts) or dtype not in _NUMPY:
        return torch.cat(list(parts), dim=dim)
    d = dim % parts[0].dim()
    shape = list(parts[0].shape)
    shape[d] = sum(int(p.shape[d]) for p in parts)
    out = torch.from_numpy(_zeros(shape, _NUMPY[dtype]))
    at = 0
    for p, z in zip(parts, zero):
        n = int(p.shape[d])
        if not z:
            out.narrow(d, at, n).copy_(p)
        at += n
    return out


#: the element types :func:`concat_zeros` allocates lazily (those of :func:`standin`)
_NUMPY = {torch.float32: np.float32, torch.int64: np.int64}


def _zeros(shape: Sequence[int], dtype: type) -> np.ndarray:
    """Zeros whose pages are allocated when written, in small pages where the system allows:
    with transparent huge pages a write into ``numpy.zeros`` memory clears a whole 2 MB page,
    so the new rows written at a KV cache's end, one per 2 MB of cache, would clear all of it.
    Pages never written read as the shared zero page."""
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * np.dtype(dtype).itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is None or nbytes == 0:
        return np.zeros(shape, dtype)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mem.madvise(advice)
    return np.frombuffer(mem, dtype, count).reshape(shape)  # keeps ``mem`` alive


def standin_params(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ``meta`` parameter replaced by its :func:`standin` (seeded by position)."""
    return {n: standin(t, i) for i, (n, t) in enumerate(params.items())}


def standin_inputs(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Every ``meta`` input replaced by its :func:`standin`."""
    return tuple(standin(x, 1000 + i) for i, x in enumerate(inputs))
