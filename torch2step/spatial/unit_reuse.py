"""Reusing unit programs across runs: each unit's program keyed by what it was specialised to.

A spatial plan's unit programs are emitted from one run (:mod:`.plan`); most of them read from
that run only a little: the structure of the streams they receive and send, a few size
expressions.  While a unit is emitted, :class:`EmitCtx` records what its emitter asked of the
run (:class:`Deps`): the streams it looked at (by name), the size expressions it evaluated (and
their values), whether each of its output channels has a reader.  A later run of the same graph
on the same chip reuses the unit's program — the same instruction tuple, not rebuilt — when
everything recorded is the same in it:

* a stream is the same when its :func:`stream_digest` is: where its stop tokens fall, the
  channel and sequence number of every message, every message's part (data by dtype and size,
  control values by value) and every tile's shape — floating-point data never enters a program;
* an expression is the same when it evaluates to the same value under the new bindings.

Units whose streams do not change with the routing (the token and weight loads, every unit of
an expert whose token count did not change, an expert's weight loads while it still gets
tokens, the sum and store after the merge) are thus taken as they are for a new routing, and
only the units whose streams changed are emitted again: the expert units whose token count
changed (their loop trip counts and buffer sizes are still that count, :mod:`.plan`), and the
routing units (selector, Partition, Reassemble), whose bodies decide from data and come out the
same, but whose bookkeeping of the messages on each channel (checked by the plan, counted in the
report) reads the routing.  Digests are computed lazily, only when a second run asks
for a unit, so a single report pays nothing for the bookkeeping.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lowering.isa import Instr

if TYPE_CHECKING:
    from .context import EmitCtx, TensorLayout
    from .plan import UnitInfo
    from .streams import StreamInfo

__all__ = ["Deps", "StreamDigests", "UnitCache", "stream_digest"]


def _nesting(data: Any, rank: int) -> list:
    """Per level, the lengths of the stream's nodes (the positions of its stop tokens)."""
    out = []
    nodes = [data]
    for _ in range(rank + 1):
        out.append([len(n) for n in nodes])
        nodes = [c for n in nodes for c in n]
    return out


def _shape(x: Any) -> Any:
    if hasattr(x, "shape"):
        return tuple(x.shape)
    if isinstance(x, tuple):
        return tuple(_shape(v) for v in x)
    return None


def stream_digest(info: StreamInfo) -> bytes:
    """A digest of everything of one run's stream a unit program can be specialised to (module
    docstring): its nesting, its messages (channel, sequence number, part) and tile shapes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(_nesting(info.value.data, info.value.rank)).encode())
    h.update(repr(info.pieces).encode())
    h.update(repr([_shape(x) for x in info.flat]).encode())
    return h.digest()


class StreamDigests:
    """The streams of one run, digested on demand (each at most once)."""

    def __init__(self, streams: Mapping[str, StreamInfo]) -> None:
        self.streams: Mapping[str, StreamInfo] | None = streams
        self._memo: dict[str, bytes] = {}

    def __getitem__(self, name: str) -> bytes:
        d = self._memo.get(name)
        if d is None:
            assert self.streams is not None, "a sealed run is asked for a stream it did not keep"
            d = self._memo[name] = stream_digest(self.streams[name])
        return d

    def seal(self, names: Iterable[str]) -> None:
        """Digest ``names`` and let the run's streams go (their tiles are large)."""
        if self.streams is not None:
            for n in names:
                self[n]
            self.streams = None


@dataclass
class Deps:
    """What one unit's emitter asked of the run: ``streams`` looked at, ``evals`` (expression,
    value) evaluated, ``dsts`` (channel, has a reader)."""

    streams: dict[str, None] = field(default_factory=dict)
    evals: list[tuple[Any, int]] = field(default_factory=list)
    dsts: dict[str, bool] = field(default_factory=dict)

    def tracking(self, has_dsts: Callable[[str], bool]) -> Callable[[str], bool]:
        """``has_dsts`` that records every channel it is asked about."""

        def ask(ch: str) -> bool:
            r = has_dsts(ch)
            self.dsts[ch] = r
            return r

        return ask


#: A unit's key besides its recorded run: the channels it reads and its stop-token counts.
Hashable = Any


@dataclass(frozen=True)
class _Entry:
    key: Hashable
    deps: Deps
    digests: StreamDigests
    body: tuple[Instr, ...]
    info: UnitInfo


class UnitCache:
    """Unit programs of one graph on one chip (with one set of unit configurations and wires)
    by unit index, each with the :class:`Deps` it was emitted under; ``emitted`` / ``reused``
    count the units built and taken as they were.  ``size``: programs kept per unit (the
    oldest dropped first)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.entries: dict[int, list[_Entry]] = {}
        self.emitted = 0
        self.reused = 0
        self._layouts: dict[str, TensorLayout] | None = None
        self._setup: Hashable = None

    def bind(self, setup: Hashable, layouts: dict[str, TensorLayout]) -> None:
        """Start a plan for ``setup`` (graph, chip, configurations, wires) whose off-chip
        tensors have ``layouts``; the programs kept are dropped when either differs."""
        if setup != self._setup or layouts != self._layouts:
            self.entries.clear()
            self._setup, self._layouts = setup, layouts
        want: dict[int, set[str]] = {}
        runs: dict[int, StreamDigests] = {}
        for kept in self.entries.values():
            for e in kept:
                runs[id(e.digests)] = e.digests
                want.setdefault(id(e.digests), set()).update(e.deps.streams)
        for i, run in runs.items():  # the earlier runs keep only the digests they need
            run.seal(want[i])

    def lookup(
        self,
        k: int,
        key: Hashable,
        ctx: EmitCtx,
        digests: StreamDigests,
        has_dsts: Callable[[str], bool],
    ) -> _Entry | None:
        """A program of unit ``k`` emitted under ``key`` whose recorded run is the same in the
        run of ``ctx`` / ``digests`` (module docstring), or ``None``."""
        for e in self.entries.get(k, ()):
            d = e.deps
            if (
                e.key == key
                and all(has_dsts(ch) == r for ch, r in d.dsts.items())
                and all(ctx.ev(x, "unit reuse") == v for x, v in d.evals)
                and all(e.digests[s] == digests[s] for s in d.streams)
            ):
                self.reused += 1
                return e
        return None

    def store(
        self,
        k: int,
        key: Hashable,
        deps: Deps,
        digests: StreamDigests,
        body: tuple[Instr, ...],
        info: UnitInfo,
    ) -> None:
        """Keep unit ``k``'s program, emitted under ``key`` with ``deps``."""
        self.emitted += 1
        kept = self.entries.setdefault(k, [])
        kept.insert(0, _Entry(key, deps, digests, body, info))
        del kept[self.size :]
