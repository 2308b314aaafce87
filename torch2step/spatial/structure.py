"""Which STeP operators become units of the fabric, which are wires, and how units connect.

Spatial execution (STeP §4.2): every STeP operator is a unit with
its own allocated compute bandwidth, and streams are channels between units.  Two refinements:

* **Wires.**  Flatten, Promote, Zip and Reshape only move stop tokens (STeP §3.2.5): their
  output elements are their input elements (Reshape adds constant padding tiles and flags).  By
  default they occupy no unit: their consumers read the underlying streams directly, which is
  what the STeP simulator's free channels amount to.  ``wires=()`` gives them units too (one
  single-cycle hop each).
* **Memory-unit pairs.**  A Streamify reads the on-chip buffers a Bufferize wrote (STeP
  §3.2.2), so it runs on the unit of that Bufferize: the buffers live in that unit's memory.

Units are listed in graph (topological) order; ``unit_edges`` gives the producer units of every
unit, looking through wires.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

from torch2step.errors import LoweringError
from torch2step.step.graph import Program
from torch2step.step.op_base import Op
from torch2step.step.ops_memory import Bufferize, Streamify

__all__ = ["DEFAULT_WIRES", "WIREABLE", "Reached", "Structure", "analyse"]

#: Operator classes that may be wires (occupy no unit).
WIREABLE = frozenset({"Flatten", "Promote", "Zip", "Reshape"})
#: The default: all of them.
DEFAULT_WIRES = WIREABLE


#: A unit a walk from a head unit reaches (:meth:`Structure.reached`): the node reached, its
#: unit's index, the unit's inputs from outside it and its outputs (stream names).
Reached = tuple[Op, int, tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Structure:
    """Units and wires of one graph.

    ``units[k]`` are the operators unit ``k`` executes (its primary operator first, then the
    Streamify nodes fused into a Bufferize unit); ``owner`` maps every non-wire node to the
    primary name of its unit; ``producer`` maps every stream name to the node making it (graph
    inputs are absent); ``preds[k]`` are the indices of the units unit ``k`` reads from.
    """

    graph: Program
    units: tuple[tuple[Op, ...], ...]
    wires: tuple[Op, ...]
    owner: dict[str, str]
    producer: dict[str, Op]
    preds: tuple[frozenset[int], ...]
    index: dict[str, int]

    @property
    def names(self) -> tuple[str, ...]:
        """Primary node name of every unit."""
        return tuple(ops[0].name for ops in self.units)

    def unit_index(self, op_name: str) -> int:
        """Index of the unit executing node ``op_name``."""
        return self.index[self.owner[op_name]]

    def sources(self, value_name: str) -> frozenset[str]:
        """Names of the unit-produced streams (channels) that stream ``value_name`` reads,
        looking through wires; empty for graph inputs."""
        return _sources(value_name, self.producer, self.owner)

    @cached_property
    def _readers(self) -> dict[str, list[int]]:
        """Stream name -> the indices of the nodes reading it, in graph order."""
        out: dict[str, list[int]] = {}
        for i, op in enumerate(self.graph.nodes):
            for v in op.inputs():
                out.setdefault(v.name, []).append(i)
        return out

    @cached_property
    def _outputs(self) -> dict[str, tuple[str, ...]]:
        """Node name -> the names of its output streams."""
        g = self.graph
        return {op.name: tuple(v.name for v in outs) for op, outs in zip(g.nodes, g.node_outputs)}

    @cached_property
    def _unit_io(self) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
        """Per unit, its inputs from outside it and its outputs (stream names)."""
        out = []
        for ops in self.units:
            own = {o.name for o in ops}
            ins = tuple(v.name for o in ops for v in o.inputs() if v.name not in own)
            out.append((ins, tuple(n for o in ops for n in self._outputs[o.name])))
        return tuple(out)

    def reached(self, reach: Iterable[str], head: int) -> Iterator[Reached]:
        """The walk a group of units downstream of unit ``head`` is found by (a statically
        tiled expert, :mod:`.tile_loop`; a region, :mod:`.region_loop`; an expert's guard,
        :mod:`.guard`): every node reading a stream of ``reach`` or an output of a node
        reached before it, in graph order, and for each one owned by a unit other than
        ``head`` (wires are walked through) that unit's :data:`Reached` entry.  A walk over
        the streams' readers, not over the graph."""
        readers, outputs, nodes = self._readers, self._outputs, self.graph.nodes
        todo = sorted({i for n in set(reach) for i in readers.get(n, ())})
        seen = set(todo)
        while todo:
            op = nodes[heapq.heappop(todo)]
            for n in outputs[op.name]:
                for j in readers.get(n, ()):
                    if j not in seen:
                        seen.add(j)
                        heapq.heappush(todo, j)
            if op.name not in self.owner:  # a wire
                continue
            k = self.unit_index(op.name)
            if k != head:
                yield (op, k, *self._unit_io[k])


def _sources(value_name: str, producer: dict[str, Op], owner: dict[str, str]) -> frozenset[str]:
    op = producer.get(value_name)
    if op is None:
        return frozenset()
    if op.name in owner:
        return frozenset({value_name})
    out: set[str] = set()
    for v in op.inputs():
        out |= _sources(v.name, producer, owner)
    return frozenset(out)


def _check_wires(wires: Iterable[str]) -> frozenset[str]:
    ws = frozenset(wires)
    bad = sorted(ws - WIREABLE)
    if bad:
        raise LoweringError(
            f"operators {bad} cannot be wires; only {sorted(WIREABLE)} move stop tokens without "
            "computing (STeP §3.2.5)"
        )
    return ws


def analyse(graph: Program, wires: Iterable[str] = DEFAULT_WIRES) -> Structure:
    """Classify the nodes of ``graph`` into units and wires (see the module docstring)."""
    ws = _check_wires(wires)
    producer: dict[str, Op] = {}
    for op, outs in zip(graph.nodes, graph.node_outputs):
        for v in outs:
            producer[v.name] = op
    units: list[list[Op]] = []
    owner: dict[str, str] = {}
    wire_ops: list[Op] = []
    for op in graph.nodes:
        if op.op_name in ws:
            wire_ops.append(op)
        elif isinstance(op, Streamify):
            src = producer.get(op.input.name)
            if not isinstance(src, Bufferize):
                what = "a graph input" if src is None else f"{src.op_name} %{src.name}"
                raise LoweringError(
                    f"Streamify %{op.name} reads buffers from {what}; spatial execution runs a "
                    "Streamify on the memory unit of the Bufferize that wrote its buffers, so "
                    "feed it the output of a Bufferize directly"
                )
            owner[op.name] = owner[src.name]
            next(u for u in units if u[0] is src).append(op)
        else:
            owner[op.name] = op.name
            units.append([op])
    index = {u[0].name: k for k, u in enumerate(units)}
    preds = []
    for k, ops in enumerate(units):
        ps: set[int] = set()
        for op in ops:
            for v in op.inputs():
                for ch in _sources(v.name, producer, owner):
                    p = index[owner[producer[ch].name]]
                    if p != k:
                        ps.add(p)
        preds.append(frozenset(ps))
    return Structure(
        graph, tuple(tuple(u) for u in units), tuple(wire_ops), owner, producer, tuple(preds), index
    )


def value_readers(graph: Program) -> dict[str, list[Op]]:
    """Every value's reading operators, in the graph's order."""
    out: dict[str, list[Op]] = {}
    for op in graph.nodes:
        for v in op.inputs():
            out.setdefault(v.name, []).append(op)
    return out
