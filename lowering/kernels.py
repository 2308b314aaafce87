"""Compute kernels a per-core program can run: shape rule, FLOP count, cycles, numpy semantics.

One registry entry per kernel (STYLE.md: one place per meaning).  The simulator asks a kernel for
its output shapes and cycle count in timing mode and calls ``run`` in functional mode.  Cycles of
a kernel on a core are ``max(ceil(flops / flops_per_cycle[dtype]), ceil(bytes / sram_bytes_per_
cycle)) + kernel_launch_cycles``: compute-bound matmuls hit the first term, elementwise kernels
the second (the roofline of one core, ELK §5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hwmodel.chip import CoreSpec
from lowering.errors import ProgramError
from lowering.isa import DTYPE_BYTES

__all__ = ["Kernel", "KERNELS", "get_kernel", "register_kernel", "kernel_cycles"]

Shape = tuple[int, ...]
Params = Mapping[str, int | float | str]


@dataclass(frozen=True, slots=True)
class Kernel:
    """A named kernel: ``out_shapes(in_shapes, params)``, ``flops(in_shapes, params)`` and
    ``run(ins, params) -> outs`` (numpy arrays)."""

    name: str
    out_shapes: Callable[[Sequence[Shape], Params], tuple[Shape, ...]]
    flops: Callable[[Sequence[Shape], Params], int]
    run: Callable[[Sequence[np.ndarray], Params], tuple[np.ndarray, ...]]


KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (a name may be registered once)."""
    if kernel.name in KERNELS:
        raise ProgramError(f"kernel {kernel.name!r} is already registered")
    KERNELS[kernel.name] = kernel
    return kernel


def get_kernel(name: str) -> Kernel:
    """The kernel called ``name``; unknown names list the registered ones."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ProgramError(
            f"unknown kernel {name!r}; registered kernels: {', '.join(sorted(KERNELS))}"
        ) from None


def kernel_cycles(
    core: CoreSpec, kernel: Kernel, in_shapes: Sequence[Shape], params: Params, dtype: str
) -> int:
    """Cycles ``kernel`` takes on ``core``: the larger of its compute and SRAM-bandwidth times."""
    flops = kernel.flops(in_shapes, params)
    elem = DTYPE_BYTES[dtype]
    touched = sum(math.prod(s) for s in in_shapes) + sum(
        math.prod(s) for s in kernel.out_shapes(in_shapes, params)
    )
    compute = math.ceil(flops / core.flops(dtype)) if flops else 0
    memory = math.ceil(touched * elem / core.sram_bytes_per_cycle)
    return max(compute, memory) + core.kernel_launch_cycles


def _matmul_shapes(shapes: Sequence[Shape], params: Params) -> tuple[Shape, ...]:
    (m, k), (k2, n) = shapes[0], shapes[1]
    if k != k2:
        raise ProgramError(f"matmul: inner dimensions differ ({m}x{k} @ {k2}x{n})")
    return ((m, n),)


def _elementwise_shapes(shapes: Sequence[Shape], params: Params) -> tuple[Shape, ...]:
    return (tuple(np.broadcast_shapes(*shapes)),)


register_kernel(
    Kernel(
        "matmul",
        _matmul_shapes,
        lambda s, p: 2 * s[0][0] * s[0][1] * s[1][1],
        lambda x, p: (x[0] @ x[1],),
    )
)
register_kernel(
    Kernel(
        "matmul_acc",  # C += A @ B; ins = (A, B, C), outs = (C,)
        lambda s, p: _matmul_shapes(s, p),
        lambda s, p: 2 * s[0][0] * s[0][1] * s[1][1],
        lambda x, p: (x[2] + x[0] @ x[1],),
    )
)
register_kernel(
    Kernel("add", _elementwise_shapes, lambda s, p: math.prod(s[0]), lambda x, p: (x[0] + x[1],))
)
register_kernel(
    Kernel("mul", _elementwise_shapes, lambda s, p: math.prod(s[0]), lambda x, p: (x[0] * x[1],))
)
register_kernel(Kernel("copy", lambda s, p: (s[0],), lambda s, p: 0, lambda x, p: (x[0].copy(),)))
register_kernel(
    Kernel(
        "zeros",  # no inputs; params: shape as "MxN" string
        lambda s, p: (tuple(int(d) for d in str(p["shape"]).split("x")),),
        lambda s, p: 0,
        lambda x, p: (np.zeros(tuple(int(d) for d in str(p["shape"]).split("x")), np.float32),),
    )
)
