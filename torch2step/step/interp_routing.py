"""Meaning of the routing and merging operators on data (STeP §3.2.3; STeP (revised) §3.2.3).

Arrival order.  A reference interpreter has no clock, so the order in which chunks *arrive*
at Reassemble and EagerMerge is a parameter of the run: ``run(..., arrival={node: seq})``
gives, for a node, the input index of every chunk in arrival order (input ``i`` appears once
per chunk it delivers).  Without it, producers are taken to run at the same rate: chunk ``k``
of input ``i`` arrives at time ``k``, ties broken by the lower input index.

* EagerMerge emits whole chunks in arrival order, with a one-hot selector naming the input.
* Reassemble, for each selector in order, takes the next chunk of every selected input and
  concatenates them in the order those chunks arrive — a chunk is never interleaved with
  another — then closes the new dimension (its stop token is one level up).
* Partition sends each chunk to every output its selector picks and records each output's
  chunk count ``N_i`` in the run's bindings (later nodes size accumulators with it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from .interp_context import Ctx
from .ops_routing import EagerMerge, Partition, Reassemble
from .runtime_check import unify_size
from .values import SelectorValue, StepRuntimeError, StreamValue, map_at, zip_at

__all__ = ["IMPLS", "arrival_keys"]


def arrival_keys(node: str, counts: list[int], ctx: Ctx) -> list[list[tuple[int, int]]]:
    """Sort key of every chunk of every input (see the module docstring)."""
    seq = ctx.arrival.get(node)
    if seq is None:
        return [[(k, i) for k in range(n)] for i, n in enumerate(counts)]
    got = Counter(seq)
    want = {i: n for i, n in enumerate(counts) if n}
    if dict(got) != want:
        raise StepRuntimeError(
            f"arrival order for %{node} lists inputs {dict(sorted(got.items()))} but the inputs "
            f"deliver {want} chunks; give each input index once per chunk"
        )
    keys: list[list[tuple[int, int]]] = [[] for _ in counts]
    for pos, i in enumerate(seq):
        keys[i].append((pos, 0))
    return keys


def _selector(x: Any, n: int, where: str) -> SelectorValue:
    if not isinstance(x, SelectorValue) or any(not 0 <= i < n for i in x.indices):
        raise StepRuntimeError(f"{where}: {x!r} is not a selector over {n} streams")
    return x


def _partition(op: Partition, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    x, s = ins
    outs: list[list] = [[] for _ in range(op.num_consumers)]
    where = f"Partition %{op.name}"

    def route(selv: Any, chunk: Any) -> None:
        for i in _selector(selv, op.num_consumers, where).indices:
            outs[i].append(chunk)

    zip_at(s.data, x.data, s.rank + 1, route, where)
    for i, (n_i, chunks) in enumerate(zip(op.counts(), outs)):
        unify_size(n_i, len(chunks), {}, ctx.env, f"{where} output {i} (chunk count)")
    return tuple(StreamValue(x.rank - s.rank, o) for o in outs)


def _reassemble(op: Reassemble, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    *streams, s = ins
    chunks = [v.data for v in streams]
    keys = arrival_keys(op.name, [len(c) for c in chunks], ctx)
    nxt = [0] * len(chunks)
    where = f"Reassemble %{op.name}"

    def gather(x: Any) -> list:
        picks = []
        for i in _selector(x, len(chunks), where).indices:
            if nxt[i] >= len(chunks[i]):
                raise StepRuntimeError(f"{where}: {x!r} selects input {i} but it has no chunk left")
            picks.append((keys[i][nxt[i]], chunks[i][nxt[i]]))
            nxt[i] += 1
        picks.sort(key=lambda p: p[0])
        return [c for _, c in picks]

    data = map_at(s.data, s.rank + 1, gather)
    left = {i: len(c) - nxt[i] for i, c in enumerate(chunks) if len(c) > nxt[i]}
    if left:
        raise StepRuntimeError(f"{where}: chunks never selected (input: count) {left}")
    return (StreamValue(ctx.out_types[0].rank, data),)


def _eager_merge(op: EagerMerge, ctx: Ctx, ins: tuple[StreamValue, ...]) -> tuple:
    chunks = [v.data for v in ins]
    keys = arrival_keys(op.name, [len(c) for c in chunks], ctx)
    order = sorted((keys[i][k], i, k) for i, cs in enumerate(chunks) for k in range(len(cs)))
    data = [chunks[i][k] for _, i, k in order]
    sels = [SelectorValue((i,)) for _, i, _ in order]
    return (StreamValue(ins[0].rank, data), StreamValue(0, sels))


IMPLS: dict[type, Callable[..., tuple]] = {
    Partition: _partition,
    Reassemble: _reassemble,
    EagerMerge: _eager_merge,
}
