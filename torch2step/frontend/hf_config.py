"""A decoder layer raised from a HuggingFace config alone: full size, shapes only.

:func:`from_hf_config` builds the family's ``*DecoderLayer`` on the ``meta`` device (no memory,
no initialisation) as a decode step (:class:`models.decoder.DecoderStep`) and raises it.  On the
meta device the raising checks that run the module (the MoE region compared with
:class:`~torch2step.layers.ops.MoEExperts`, attention masks) have no numbers to run, so the same
family is first raised at a small size with random weights — a *stand-in of the same structure*
(same family, attention kind, routing, norms, activation) on which every check runs — and the
full-size graph must have the same operators in the same order.
"""

from __future__ import annotations

from typing import Any

from torch2step.errors import FrontendError
from torch2step.layers.graph import LayerGraph

__all__ = ["from_hf_config", "standin_config", "same_structure"]


def _field(cfg: Any, *names: str) -> Any:
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)


def standin_config(config: Any) -> Any:
    """A small config of the same structure as ``config``: hidden 64, head dim 16, query
    heads 4 with the same grouping kind (MHA / GQA / MQA), at most 8 experts, the same top-k,
    routing normalisation, norms, activation and RoPE base."""
    from models.decoder import hf_config

    cfg = hf_config(config)
    d = cfg.to_dict()
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    kv = 4 if hkv == hq else (1 if hkv == 1 else 2)
    d.update(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=kv, head_dim=16,
        intermediate_size=96, num_hidden_layers=1, vocab_size=128,
    )  # fmt: skip
    for key in ("num_local_experts", "num_experts"):
        if d.get(key):
            d[key] = max(min(d[key], 8), (_field(cfg, "num_experts_per_tok") or 1) + 1)
    if d.get("moe_intermediate_size"):
        d["moe_intermediate_size"] = 32
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        d.pop(key, None)
    d.pop("layer_types", None)
    d.pop("max_window_layers", None)
    return hf_config(d)


def same_structure(full: LayerGraph, small: LayerGraph) -> str | None:
    """None when both graphs have the same operator kinds in the same order (sizes aside),
    else the first difference."""
    a = [type(n.op).__name__ for n in full.nodes]
    b = [type(n.op).__name__ for n in small.nodes]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"operator {i} is {x} at full size but {y} in the stand-in"
    if len(a) != len(b):
        return f"{len(a)} operators at full size but {len(b)} in the stand-in"
    return None


def from_hf_config(
    config: Any, *, batch: int = 2, past: int = 8, name: str | None = None, check: bool = True
) -> LayerGraph:
    """Raise layer 0 of ``config`` (a ``config.json`` path, dict or transformers config) as a
    decode step ``(x, past_k, past_v) -> (out, new_k, new_v)`` at full size on the meta device.

    ``batch``/``past`` only size the example (both stay dynamic in the graph); ``check``
    raises a small random stand-in first (see the module docstring)."""
    from models.decoder import decode_inputs, decoder_step, hf_config
    from torch2step.frontend.torch_import import from_torch

    cfg = hf_config(config)
    label = name or f"{cfg.model_type}_decoder"
    small = None
    if check:
        tiny = standin_config(cfg)
        step = decoder_step(tiny, device="cpu")
        small = from_torch(step, decode_inputs(tiny, 2, 4), name=label)
    step = decoder_step(cfg, device="meta")
    graph = from_torch(step, decode_inputs(cfg, batch, past, device="meta"), name=label)
    if small is not None:
        why = same_structure(graph, small)
        if why is not None:
            raise FrontendError(
                f"{label}: the full-size {type(step.layer).__name__} does not raise like its "
                f"small stand-in ({why}); the checks that need numbers cannot vouch for it. "
                "Compile the module with real weights instead."
            )
    return graph
