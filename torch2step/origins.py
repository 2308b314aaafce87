"""Which operator of the user's layer each STeP node came from.

The lowering records the layer operator whose rule added each STeP node
(``Lowered.made_by``), which names it even when operators stream into each other
(``stream_rows``).  A node without that record is named by its group: the STeP nodes one
layer operator lowers to are joined by streams to the store into that operator's output
tensor (``Lowered.placed``), so :func:`step_origins` finds the stream-connected groups
(union-find over stream edges) and names each by the layer operator whose output tensor it
writes.  Nodes of a per-expert (or per-lane) branch, named ``<layer node>_e<k>_...`` /
``..._l<k>_...`` by the lowering, are named per expert / lane within it.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["step_origins"]

_BRANCH = re.compile(r"^(e\d+|l\d+|lane\d+)$")
_STORES = ("LinearOffChipStore", "RandomOffChipStore")


def _find(parent: list[int], k: int) -> int:
    while parent[k] != k:
        parent[k] = parent[parent[k]]
        k = parent[k]
    return k


def step_origins(lowered: Any) -> dict[str, str]:
    """STeP node name -> ``"<layer node> (<operator>)"``, with `` e<k>`` for an expert branch;
    nodes whose group stores to no layer output are absent."""
    prog, layer = lowered.program, lowered.layer
    producer = {v.name: k for k, outs in enumerate(prog.node_outputs) for v in outs}
    parent = list(range(len(prog.nodes)))
    for k, op in enumerate(prog.nodes):
        for v in op.inputs():
            j = producer.get(v.name)
            if j is not None:
                parent[_find(parent, k)] = _find(parent, j)
    writer: dict[str, Any] = {}
    for node in layer.nodes:
        for out in node.outputs:
            placed = lowered.placed.get(out)
            if placed is not None:
                writer.setdefault(placed.tensor.name, node)
    group: dict[int, Any] = {}
    for k, op in enumerate(prog.nodes):
        if type(op).__name__ in _STORES:
            for t in op.tensors():
                if t.name in writer:
                    group.setdefault(_find(parent, k), writer[t.name])
    by_name = {n.name: n for n in layer.nodes}
    made_by = getattr(lowered, "made_by", {})
    out: dict[str, str] = {}
    for k, op in enumerate(prog.nodes):
        node = by_name.get(made_by.get(op.name, ""), group.get(_find(parent, k)))
        if node is None:
            continue
        label = f"{node.name} ({type(node.op).__name__})"
        rest = op.name[len(node.name) + 1 :].split("_") if op.name.startswith(node.name) else []
        if rest and _BRANCH.match(rest[0]):
            label += f" {rest[0]}"
        out[op.name] = label
    return out
