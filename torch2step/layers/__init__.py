"""The layer graph: a small typed IR of tensor operations (linear/matmul, elementwise, RMSNorm,
LayerNorm, softmax, rotary embedding, top-k routing, MoE experts, attention, concat, gather,
views) that the torch.export and ONNX frontends raise models into, and that lowering turns into
STeP."""

from torch2step.layers.evaluate import evaluate
from torch2step.layers.graph import LayerGraph, Node, format_layer_graph
from torch2step.layers.ops import (
    Arange,
    Attention,
    Cast,
    Concat,
    Elementwise,
    Gather,
    LayerNorm,
    LayerOp,
    Linear,
    MatMul,
    MoEExperts,
    Permute,
    Reduce,
    Reshape,
    RMSNorm,
    Rotary,
    Slice,
    Softmax,
    TensorType,
    TopKRouting,
)
from torch2step.layers.stack import Repeat

__all__ = [
    "Repeat",
    "Arange",
    "Attention",
    "Cast",
    "Concat",
    "Elementwise",
    "Gather",
    "LayerGraph",
    "LayerNorm",
    "LayerOp",
    "Linear",
    "MatMul",
    "MoEExperts",
    "Node",
    "Permute",
    "RMSNorm",
    "Reduce",
    "Reshape",
    "Rotary",
    "Slice",
    "Softmax",
    "TensorType",
    "TopKRouting",
    "evaluate",
    "format_layer_graph",
]
