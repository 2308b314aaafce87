"""Workloads: HuggingFace-style MoE and GQA layers with real configs, and the real traces.

- :mod:`models.configs`: Mixtral-8x7B and Qwen3-30B-A3B MoE, Qwen3-30B-A3B and Llama-3-8B
  attention (published numbers) and their ``tiny()`` test variants.
- :class:`MoEBlock` (``impl`` = ``loop`` | ``dense`` | ``gather`` | ``grouped``) and :class:`GQADecode`
  (``attn`` = ``sdpa`` | ``eager``; tensor-in/tensor-out decode step), seeded and deterministic.
- :mod:`models.hf`: the real transformers modules built from the same config and seed.
- :func:`get_layer` / :data:`LAYERS`: named layers with example inputs for the CLI.
- :mod:`models.traces`: per-token expert choices and per-request KV lengths (STeP §5).
"""

from __future__ import annotations

from models import traces
from models.attention import ATTN_IMPLS, GQADecode, RMSNorm, kv_length_mask
from models.configs import (
    LLAMA3_8B_ATTENTION,
    MIXTRAL_8X7B_MOE,
    QWEN3_30B_A3B_ATTENTION,
    QWEN3_30B_A3B_MOE,
    AttentionConfig,
    MoEConfig,
)
from models.errors import (
    TraceFormatError,
    UnknownLayerError,
    UnknownNameError,
    UnknownTraceError,
)
from models.init import attention_weights, moe_weights
from models.moe import MOE_IMPLS, MoEBlock
from models.registry import HF_CONFIGS, HF_MOE_IMPLS, LAYERS, LayerEntry, LayerSpec, get_layer

__all__ = [
    "traces",
    "MoEConfig",
    "AttentionConfig",
    "MIXTRAL_8X7B_MOE",
    "QWEN3_30B_A3B_MOE",
    "QWEN3_30B_A3B_ATTENTION",
    "LLAMA3_8B_ATTENTION",
    "MoEBlock",
    "MOE_IMPLS",
    "GQADecode",
    "ATTN_IMPLS",
    "RMSNorm",
    "kv_length_mask",
    "moe_weights",
    "attention_weights",
    "LAYERS",
    "LayerEntry",
    "LayerSpec",
    "get_layer",
    "HF_CONFIGS",
    "HF_MOE_IMPLS",
    "UnknownNameError",
    "UnknownLayerError",
    "UnknownTraceError",
    "TraceFormatError",
]
