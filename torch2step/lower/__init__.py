"""Lowering of the layer graph to one STeP program (STeP §3, §5).

``lower(layer_graph, LowerOptions(...)) -> Lowered``: each layer operator becomes a STeP
subgraph (:data:`RULES`) between off-chip tensors (:mod:`.context` explains the storage
model); ``Lowered.feed`` / ``Lowered.outputs`` are the host side of a run.
"""

from .context import HostIndex, LowerOptions, Placed
from .lower import Lowered, lower
from .rules import RULES

__all__ = ["RULES", "HostIndex", "LowerOptions", "Lowered", "Placed", "lower"]
