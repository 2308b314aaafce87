"""Run-time stream values for the reference interpreter (STeP §3.1, Revet §III-A).

A :class:`StreamValue` of rank ``r`` holds its ``D_r`` tensors as nested Python lists
(``data``: depth ``r + 1``; the leaves are elements: numpy tiles, :class:`SelectorValue`,
:class:`BufferValue` or tuples).  Its stop-token form is explicit and exact:
:meth:`StreamValue.tokens` / :meth:`StreamValue.from_tokens` follow the STeP/Revet encoding —
the end of dimension ``k`` is the stop token ``S_k``; at the end of several dimensions only
the highest token is emitted; an empty dimension still emits its own token, so ``[[]]``,
``[[], []]`` and ``[]`` (rank 2) are ``S1 S2``, ``S1 S1 S2`` and ``S2`` (Revet §III-A);
each of the ``D_r`` tensors ends with ``S_r`` and the stream ends with the done token ``D``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from torch2step.errors import Torch2StepError

__all__ = [
    "DONE",
    "BufferValue",
    "Done",
    "SelectorValue",
    "Stop",
    "StepRuntimeError",
    "StreamValue",
    "decode_tokens",
    "encode_tokens",
    "sel",
]


class StepRuntimeError(Torch2StepError):
    """The reference interpreter met data that breaks an operator's contract (a selected
    input without a chunk, a shape the rule does not predict, an address out of range...)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The stop token ``S_level`` (end of dimension ``level - 1``; ``level >= 1``)."""

    level: int

    def __repr__(self) -> str:
        return f"S{self.level}"


@dataclass(frozen=True, slots=True)
class Done:
    """The done token ``D`` ending a stream."""

    def __repr__(self) -> str:
        return "D"


DONE = Done()


@dataclass(frozen=True, slots=True)
class SelectorValue:
    """A multi-hot selector: the sorted indices of the chosen outputs/inputs."""

    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(sorted(int(i) for i in self.indices)))
        if len(set(self.indices)) != len(self.indices):
            raise StepRuntimeError(f"selector {self.indices} selects an index twice")

    def __repr__(self) -> str:
        return "sel(" + ", ".join(map(str, self.indices)) + ")"


def sel(*indices: int) -> SelectorValue:
    """``sel(0, 3)``: a selector choosing 0 and 3."""
    return SelectorValue(tuple(indices))


_buffer_ids = count()


@dataclass(eq=False)
class BufferValue:
    """A reference to an on-chip buffer holding ``data`` (nested lists, depth = buffer rank)."""

    data: list
    nbytes: int
    id: int = field(default_factory=lambda: next(_buffer_ids))

    def __repr__(self) -> str:
        return f"buf#{self.id}({self.nbytes} B)"


def _body(x: list, k: int, out: list) -> None:
    for j, c in enumerate(x):
        if k == 1:
            out.append(c)
            continue
        _body(c, k - 1, out)
        if j < len(x) - 1 or len(c) == 0:
            out.append(Stop(k - 1))


def encode_tokens(data: list, rank: int) -> list:
    """Stop-token sequence of a stream's nested data (see the module docstring)."""
    out: list = []
    for t in data:
        if rank == 0:
            out.append(t)
        else:
            _body(t, rank, out)
            out.append(Stop(rank))
    out.append(DONE)
    return out


def decode_tokens(tokens: Iterable[Any], rank: int) -> list:
    """Inverse of :func:`encode_tokens`."""
    result: list = []
    cur: list[list] = [[] for _ in range(rank + 1)]  # cur[k]: open list at level k (k >= 1)
    done = False
    for tok in tokens:
        if done:
            raise StepRuntimeError("tokens after the done token")
        if isinstance(tok, Done):
            if any(cur[k] for k in range(1, rank + 1)):
                raise StepRuntimeError("stream ends inside an open dimension (missing stop token)")
            done = True
        elif isinstance(tok, Stop):
            k = tok.level
            if not 1 <= k <= rank:
                raise StepRuntimeError(f"stop token S{k} in a rank-{rank} stream")
            for j in range(1, k):
                if cur[j]:
                    cur[j + 1].append(cur[j])
                    cur[j] = []
            (result if k == rank else cur[k + 1]).append(cur[k])
            cur[k] = []
        elif rank == 0:
            result.append(tok)
        else:
            cur[1].append(tok)
    if not done:
        raise StepRuntimeError("stream has no done token")
    return result


@dataclass
class StreamValue:
    """A stream's value: ``rank`` and the nested list of its ``D_rank`` tensors."""

    rank: int
    data: list

    def tokens(self) -> list:
        """The stop-token form ``[e, e, S1, e, S2, ..., D]``."""
        return encode_tokens(self.data, self.rank)

    @classmethod
    def from_tokens(cls, tokens: Iterable[Any], rank: int) -> StreamValue:
        return cls(rank, decode_tokens(tokens, rank))

    def elements(self) -> Iterator[Any]:
        """Elements in stream order."""
        yield from iter_leaves(self.data, self.rank + 1)

    def extents(self) -> list:
        """The observed shape: nested lengths (a number per list), for debugging."""
        return _extents(self.data, self.rank + 1)

    def __repr__(self) -> str:
        return f"StreamValue(rank={self.rank}, tokens={self.tokens()!r})"


def _extents(node: Any, depth: int) -> Any:
    if depth == 1:
        return len(node)
    return [len(node), [_extents(c, depth - 1) for c in node]]


def iter_leaves(node: Any, depth: int) -> Iterator[Any]:
    """Leaves of a nested list ``depth`` levels deep, row-major."""
    if depth == 0:
        yield node
        return
    for c in node:
        yield from iter_leaves(c, depth - 1)


def map_at(node: Any, depth: int, f: Callable[[Any], Any]) -> Any:
    """Apply ``f`` to every object ``depth`` levels down (``depth == 0``: ``node`` itself)."""
    if depth == 0:
        return f(node)
    return [map_at(c, depth - 1, f) for c in node]


def map_at_pos(
    node: Any, depth: int, f: Callable[[Any, tuple[int, ...]], Any], pos: tuple[int, ...] = ()
) -> Any:
    """Like :func:`map_at` and ``f`` also gets the position (one index per level)."""
    if depth == 0:
        return f(node, pos)
    return [map_at_pos(c, depth - 1, f, (*pos, j)) for j, c in enumerate(node)]


def zip_at(a: Any, b: Any, depth: int, f: Callable[[Any, Any], Any], what: str) -> Any:
    """Walk two nested lists in lockstep for ``depth`` levels, then ``f(a_sub, b_sub)``."""
    if depth == 0:
        return f(a, b)
    if len(a) != len(b):
        raise StepRuntimeError(f"{what}: streams differ in shape ({len(a)} vs {len(b)} items)")
    return [zip_at(x, y, depth - 1, f, what) for x, y in zip(a, b)]
