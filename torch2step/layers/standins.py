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

from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = ["standin", "standin_params", "standin_inputs", "SMALL"]

#: Tensors of at most this many elements get random values; larger ones lazy zeros.
SMALL = 1 << 20


def standin(t: torch.Tensor, seed: int, small: int = SMALL) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape for a ``meta`` tensor ``t`` (``t`` itself otherwise)."""
    if not t.is_meta:
        return t
    shape = tuple(int(d) for d in t.shape)
    if t.dtype.is_floating_point:
        if t.numel() <= small:
            gen = torch.Generator().manual_seed(seed)
            scale = shape[-1] ** -0.5 if shape else 1.0
            return torch.randn(shape, generator=gen) * scale
        return torch.from_numpy(np.zeros(shape, np.float32))
    return torch.from_numpy(np.zeros(shape, np.int64))


def standin_params(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ``meta`` parameter replaced by its :func:`standin` (seeded by position)."""
    return {n: standin(t, i) for i, (n, t) in enumerate(params.items())}


def standin_inputs(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Every ``meta`` input replaced by its :func:`standin`."""
    return tuple(standin(x, 1000 + i) for i, x in enumerate(inputs))
