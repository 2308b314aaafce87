"""Kernels of ELK per-core programs (ELK §4.5 ``local_execute``) beyond the basic ones in
:mod:`lowering.kernels`: flash-decoding attention partials and their merge, a row-wise vector
operator timed by its FLOPs per element, and a layer-graph node evaluated on one core.

A matrix product may write its result as pieces of whole slices (``mm_parts``), the pieces a
reduce-scatter sends to the other cores of a grid column, and ``add_parts`` adds a received
buffer into the pieces it covers (the recursive halving of :mod:`lowering.elk_programs`).

Attention partials travel as one buffer ``(rows, heads, D + 2)``: the unnormalised output, the
running maximum and the running sum of exponentials, so merging two partials is elementwise.
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lowering.errors import ProgramError
from lowering.kernels import KERNELS, Kernel, register_kernel

__all__ = ["register_node", "NODE_KERNELS", "NodeKernel", "NodeKey"]

#: A layer-graph node's evaluation: its inputs' values -> its outputs' values.
NodeFn = Callable[[Sequence[np.ndarray]], tuple[np.ndarray, ...]]


class NodeKernel:
    """What a ``layer_node`` kernel evaluates: the node's output shapes and its function."""

    __slots__ = ("out_shapes", "fn", "__weakref__")

    def __init__(self, out_shapes: tuple[tuple[int, ...], ...], fn: NodeFn) -> None:
        self.out_shapes = out_shapes
        self.fn = fn


class NodeKey(str):
    """The key :func:`register_node` gives a node: a plain string (an ``Operator.node``, a
    ``compute layer_node {node=key}`` parameter) that also holds its :class:`NodeKernel`.

    Whatever holds the key (the operators of a compiled program, its schedule, its per-core
    programs) keeps the kernel registered; once nothing does, the kernel leaves
    :data:`NODE_KERNELS`.  Copies are the same object; a pickled key is a plain string, looked
    up in :data:`NODE_KERNELS` where it is unpickled (a forked worker inherits the registry)."""

    kernel: NodeKernel

    def __new__(cls, key: str, kernel: NodeKernel) -> NodeKey:
        """``key`` holding ``kernel``."""
        self = super().__new__(cls, key)
        self.kernel = kernel
        return self

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        """Pickled as a plain string (a function of a layer graph does not pickle)."""
        return (str, (str(self),))

    def __copy__(self) -> NodeKey:
        """Immutable: a copy is the key itself (and keeps its kernel)."""
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> NodeKey:
        """Immutable: a copy is the key itself (and keeps its kernel)."""
        return self


#: Layer-graph nodes a ``layer_node`` kernel may evaluate: key -> kernel.  Held weakly: a
#: kernel stays while a key :func:`register_node` returned for it is held (by the operators
#: of the program compiled with it), so one program's kernels are never another's.
NODE_KERNELS: weakref.WeakValueDictionary[str, NodeKernel] = weakref.WeakValueDictionary()

_SERIAL = itertools.count()


def register_node(key: str, out_shapes: tuple[tuple[int, ...], ...], fn: NodeFn) -> NodeKey:
    """Make ``fn`` runnable as ``compute layer_node {node=k}`` and return ``k``: ``key`` made
    unique in this process (``key#<process>.<serial>``), so a node of the same name in
    another graph, or in the same graph compiled for other sizes, gets a key of its own.  The
    kernel stays registered while ``k`` (or an operator or program holding it) is held."""
    kernel = NodeKernel(out_shapes, fn)
    unique = NodeKey(f"{key}#{os.getpid()}.{next(_SERIAL)}", kernel)
    NODE_KERNELS[str(unique)] = kernel  # a plain key: the registry holds no kernel
    return unique


def _node(p: Any) -> NodeKernel:
    key = p["node"]
    kernel = getattr(key, "kernel", None) or NODE_KERNELS.get(str(key))
    if kernel is None:
        raise ProgramError(
            f"layer_node kernel: node {str(key)!r} is not registered in this process: its "
            "program is gone or was made in another process; compile the layer here "
            "(register_node registers its nodes)"
        )
    return kernel


def _partial(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    q, k, v = x[0], x[1], x[2]  # q (b, hkv*g, D); k, v (b, hkv, l, D)
    g = int(p["group"])
    scale = float(p["scale"])
    b, hq, d = q.shape
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    s = np.einsum("bhd,bhld->bhl", q.astype(np.float64), kk.astype(np.float64)) * scale
    m = s.max(axis=-1)
    e = np.exp(s - m[..., None])
    o = np.einsum("bhl,bhld->bhd", e, vv.astype(np.float64))
    out = np.concatenate([o, m[..., None], e.sum(-1)[..., None]], axis=-1)
    return (out.astype(np.float32),)


def _merge(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    a, b = x[0].astype(np.float64), x[1].astype(np.float64)
    d = a.shape[-1] - 2
    ma, mb = a[..., d], b[..., d]
    m = np.maximum(ma, mb)
    fa, fb = np.exp(ma - m), np.exp(mb - m)
    o = a[..., :d] * fa[..., None] + b[..., :d] * fb[..., None]
    s = a[..., d + 1] * fa + b[..., d + 1] * fb
    return (np.concatenate([o, m[..., None], s[..., None]], axis=-1).astype(np.float32),)


def _finish(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    a = x[0]
    d = a.shape[-1] - 2
    return ((a[..., :d] / a[..., d + 1 : d + 2]).astype(np.float32),)


def _vector_run(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    raise ProgramError(
        "elk_vector is a timing-only stand-in for a vector operator of a shapes-only model; "
        "compile a layer graph (torch2step.compile(..., execution='kernel')) to run it"
    )


if "attn_partial" not in KERNELS:
    register_kernel(
        Kernel(
            "attn_partial",
            lambda s, p: ((s[0][0], s[0][1], s[0][2] + 2),),
            lambda s, p: 4 * s[0][0] * s[0][1] * s[1][2] * s[0][2],
            _partial,
        )
    )
    register_kernel(
        Kernel("attn_merge", lambda s, p: (s[0],), lambda s, p: 6 * math.prod(s[0]), _merge)
    )
    register_kernel(
        Kernel(
            "attn_finish",
            lambda s, p: ((*s[0][:-1], s[0][-1] - 2),),
            lambda s, p: math.prod(s[0]),
            _finish,
        )
    )
    register_kernel(
        Kernel(
            "elk_vector",  # params: fpe (FLOPs per element); output shaped as the first input
            lambda s, p: (s[0],),
            lambda s, p: int(p["fpe"]) * math.prod(s[0]),
            _vector_run,
        )
    )
    register_kernel(
        Kernel(
            "layer_node",  # params: node (a key register_node gave, see NODE_KERNELS)
            lambda s, p: _node(p).out_shapes,
            lambda s, p: 2 * sum(math.prod(o) for o in _node(p).out_shapes),
            lambda x, p: _node(p).fn(x),
        )
    )


def _sizes(p: Any) -> tuple[int, ...]:
    """Slices per output of ``mm_parts``: ``sizes`` ("2,1,1") or ``parts`` slices of one."""
    if "sizes" in p:
        return _ints(p["sizes"])
    return (1,) * int(p["parts"])


def _parts_shapes(s: Sequence[tuple[int, ...]], p: Any) -> tuple[tuple[int, ...], ...]:
    (m, k), (k2, n) = s[0], s[1]
    sizes, axis = _sizes(p), int(p["axis"])
    t = sum(sizes)
    if k != k2 or (m, n)[axis] % t:
        raise ProgramError(f"mm_parts: {m}x{k} @ {k2}x{n} into {t} slices along axis {axis}")
    if axis == 0:
        return tuple((m // t * z, n) for z in sizes)
    return tuple((m, n // t * z) for z in sizes)


def _cuts(extents: Sequence[int]) -> list[int]:
    """Split points of consecutive pieces ``extents`` long (for ``np.split``)."""
    return list(np.cumsum(extents)[:-1])


def _parts_run(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    sizes, axis = _sizes(p), int(p["axis"])
    y = x[0] @ x[1]
    if len(x) > 2:  # accumulate into the parts
        y = y + np.concatenate(x[2:], axis=axis)
    step = y.shape[axis] // sum(sizes)
    return tuple(np.split(y, _cuts([z * step for z in sizes]), axis=axis))


def _add_shapes(s: Sequence[tuple[int, ...]], p: Any) -> tuple[tuple[int, ...], ...]:
    axis = int(p["axis"])
    if len(s) < 2 or sum(q[axis] for q in s[1:]) != s[0][axis]:
        raise ProgramError(f"add_parts: pieces {s[1:]} do not tile {s[0]} along axis {axis}")
    return tuple(s[1:])


def _add_run(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    axis = int(p["axis"])
    pieces = np.split(x[0], _cuts([q.shape[axis] for q in x[1:]]), axis=axis)
    return tuple(q + t for q, t in zip(x[1:], pieces))


if "mm_parts" not in KERNELS:
    register_kernel(
        Kernel(  # params: axis and parts (slices of one) or sizes (slices per output, "2,1,1");
            # ins (A, B) or (A, B, C_0 .. C_last): C += A @ B
            "mm_parts",  # the product written as pieces (a reduce-scatter's sends)
            _parts_shapes,
            lambda s, p: 2 * s[0][0] * s[0][1] * s[1][1],
            _parts_run,
        )
    )
    register_kernel(
        Kernel(  # params: axis; ins (T, P_0 .. P_last), the P_i tiling T along axis in order
            "add_parts",  # P_i += its part of T (a received half added into the kept pieces)
            _add_shapes,
            lambda s, p: math.prod(s[0]),
            _add_run,
        )
    )


def _ints(s: object) -> tuple[int, ...]:
    return tuple(int(v) for v in str(s).split(",") if v != "")


def _view2d(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1) if a.ndim >= 2 else a.reshape(1, -1)


def _slice_run(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    (r, c), (er, ec) = _ints(p["at"]), _ints(p["ext"])
    return (_view2d(x[0])[r : r + er, c : c + ec].copy(),)


def _place_run(x: Sequence[np.ndarray], p: Any) -> tuple[np.ndarray, ...]:
    shape = _ints(p["shape"])
    out = np.zeros(shape, dtype=np.result_type(*x) if len(x) else np.float32)
    flat = _view2d(out)
    for piece, at in zip(x, str(p["at"]).split(";")):
        r, c = _ints(at)
        piece = _view2d(piece)
        if flat[r : r + piece.shape[0], c : c + piece.shape[1]].shape != piece.shape:
            raise ProgramError(f"elk_place: {piece.shape} at {at} into {shape} {p}")
        flat[r : r + piece.shape[0], c : c + piece.shape[1]] = piece
    return (out,)


if "elk_slice" not in KERNELS:
    register_kernel(
        Kernel(  # params: at, ext ("row,col" in the 2-D view ``(dim0, rest)`` of the input)
            "elk_slice",
            lambda s, p: (_ints(p["ext"]),),
            lambda s, p: 0,
            _slice_run,
        )
    )
    register_kernel(
        Kernel(  # params: shape ("d0,d1,..") and at (the 2-D offset of every input, ";"-joined)
            "elk_place",
            lambda s, p: (_ints(p["shape"]),),
            lambda s, p: 0,
            _place_run,
        )
    )
