"""Read-after-write through HBM: a load of an off-chip tensor waits for the stores before it.

STeP graphs of a whole layer chain sub-programs through off-chip tensors: a
LinearOffChipStore / RandomOffChipStore writes tensor ``t`` and a node later in program order
loads ``t``.  The reference interpreter runs nodes in program order, so the load sees the
stored data; on the fabric every unit runs at once, so the dependence is made explicit:

* every storing unit that some later load depends on ends its program with a *fence* (a
  barrier of its own core alone: it waits until all its HBM writes have completed, ELK §5
  counts a write done when the data is in HBM) and then sends one *completion token* (a
  control value) on the channel ``<store>.done``, multicast to every unit that loads ``t``
  later in program order;
* a loading unit receives the tokens of all earlier stores of ``t`` just before its first
  access of ``t`` (a unit that never accesses ``t`` — an empty stream — receives them at its
  end, so no token is left unreceived).

Granularity: the whole tensor.  A load of ``t`` starts only when *every* earlier store of
``t`` has completed, as in program order; tiles are not tracked one by one, so a stage that
could start on the first stored tiles waits for the last one (sub-programs do not overlap
through HBM).  The token costs one control message on the NoC (hops x hop latency plus one
cycle of link occupancy).

Assumptions: each off-chip tensor is written once per graph (the layer lowering's rule);
tensors that are graph inputs are already present, so a load that precedes every store of its
tensor in program order (a KV cache that a later RandomOffChipStore appends one row to) does not
wait, and write-after-read and write-after-write are not ordered.  When a later sub-program also
reads a stream of the earlier one *directly* (a residual), that stream's FIFO fills while its
consumer waits for the token; the simulation then deepens it (:mod:`.fifos`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch2step.step.graph import Program
from torch2step.step.ops_memory import (
    LinearOffChipLoad,
    LinearOffChipStore,
    RandomOffChipLoad,
    RandomOffChipStore,
)

__all__ = ["OffChipDep", "offchip_deps", "token_channel", "fence_group"]

_LOADS = (LinearOffChipLoad, RandomOffChipLoad)
_STORES = (LinearOffChipStore, RandomOffChipStore)


@dataclass(frozen=True, slots=True)
class OffChipDep:
    """Store node ``store`` writes tensor ``tensor``; the load nodes ``loads`` (later in
    program order) read it and wait for its completion token."""

    tensor: str
    store: str
    loads: tuple[str, ...]


def token_channel(store: str) -> str:
    """Name of the completion-token channel of store node ``store`` (not an identifier, so it
    never collides with a stream name)."""
    return f"{store}.done"


def fence_group(unit: str) -> str:
    """Name of the one-core barrier group the storing unit ``unit`` fences with."""
    return f"{unit}.fence"


def offchip_deps(graph: Program) -> tuple[OffChipDep, ...]:
    """Every store that a later load of the same tensor depends on (program order)."""
    out: list[OffChipDep] = []
    nodes = graph.nodes
    for i, op in enumerate(nodes):
        if not isinstance(op, _STORES):
            continue
        t = op.tensor.name
        loads = tuple(
            later.name
            for later in nodes[i + 1 :]
            if isinstance(later, _LOADS) and later.tensor.name == t
        )
        if loads:
            out.append(OffChipDep(t, op.name, loads))
    return tuple(out)
