"""STeP builders of the two layers of STeP §5, called by the lowering: the SwiGLU
Mixture-of-Experts block with dynamic tiling of experts (Fig. 2, §5.2) and grouped-query
attention in decode with an online softmax over ragged KV caches (§5.1, §5.4).

``add_moe`` / ``add_gqa_decode`` add a layer to a bigger :class:`~torch2step.step.Graph`;
``moe_graph`` / ``gqa_decode_graph`` build a program holding only the layer; ``*_inputs``
make random tensors for :func:`torch2step.step.run` and ``*_reference`` compute the same layer
in plain PyTorch.
"""

from torch2step.step import fn_library_models as _fn_library_models  # noqa: F401  (registers)

from .gqa import add_gqa_decode, gqa_decode_graph, gqa_inputs, gqa_reference
from .moe import ACTIVATIONS, add_moe, default_tile, moe_graph, moe_inputs, moe_reference

__all__ = [
    "ACTIVATIONS",
    "add_gqa_decode",
    "add_moe",
    "default_tile",
    "gqa_decode_graph",
    "gqa_inputs",
    "gqa_reference",
    "moe_graph",
    "moe_inputs",
    "moe_reference",
]
