"""Real HuggingFace ``transformers`` modules built from our configs, with seeded weights.

transformers (>= 5.0) is a test extra; it is imported lazily here so that the rest of ``models``
works without it. Everything runs offline (nothing is downloaded: the modules are built from
config objects). Standalone HF blocks leave their expert weights uninitialised (``torch.empty``)
and the Qwen3 router at zeros (top-k ties), so every builder here writes the canonical seeded
tensors of :mod:`models.init` — the same ``(config, seed)`` as our :class:`~models.moe.MoEBlock` /
:class:`~models.attention.GQADecode` gives identical weights.

What the HF modules return (transformers 5.23): ``MixtralSparseMoeBlock`` and
``Qwen3MoeSparseMoeBlock`` take ``(batch, seq, hidden)`` only (they unpack three sizes) and return
one tensor of that shape (router logits are recorded by hooks, not returned). ``Qwen3Attention``
/ ``LlamaAttention`` take ``(hidden_states, position_embeddings=(cos, sin), attention_mask,
past_key_values)`` and return ``(attn_output, attn_weights)`` — ``attn_weights`` is ``None`` for
sdpa and the ``(B, heads, q, kv)`` probabilities for eager — while the cache is updated in place.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn

from models.attention import GQADecode, kv_length_mask
from models.configs import AttentionConfig, MoEConfig
from models.init import attention_weights, moe_weights
from models.moe import MoEBlock

__all__ = [
    "HF_EXPERTS_IMPLS",
    "hf_moe_config",
    "build_hf_moe",
    "copy_moe_weights",
    "hf_attention_config",
    "build_hf_attention",
    "copy_attention_weights",
    "hf_decode_step",
]

HF_EXPERTS_IMPLS: tuple[str, ...] = ("eager", "batched_mm", "grouped_mm")
_HF_ATTENTION_CLASSES = ("Qwen3Attention", "Qwen3MoeAttention", "LlamaAttention")


_MODELING = {
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "Qwen3MoeAttention": "qwen3_moe",
    "Qwen3Attention": "qwen3",
    "LlamaAttention": "llama",
}


def _hf_class(name: str) -> type[nn.Module]:
    """A class from ``transformers.models.<family>.modeling_<family>``."""
    _transformers()
    family = _MODELING[name]
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "models.hf needs HuggingFace transformers >= 5.0: pip install 'torch2step[test]'"
        ) from exc
    return transformers


def hf_moe_config(config: MoEConfig, experts_implementation: str = "batched_mm") -> Any:
    """``MixtralConfig`` (router_style ``"mixtral"``) or ``Qwen3MoeConfig`` (``"qwen3"``)."""
    if experts_implementation not in HF_EXPERTS_IMPLS:
        raise ValueError(
            f"hf_moe_config: unknown experts_implementation {experts_implementation!r}; "
            f"choose one of {', '.join(HF_EXPERTS_IMPLS)}"
        )
    tf = _transformers()
    common = {
        "hidden_size": config.hidden_size,
        "num_experts_per_tok": config.top_k,
        "num_hidden_layers": 1,
    }
    if config.router_style == "mixtral":
        return tf.MixtralConfig(
            intermediate_size=config.intermediate_size,
            num_local_experts=config.num_experts,
            experts_implementation=experts_implementation,
            **common,
        )
    return tf.Qwen3MoeConfig(
        moe_intermediate_size=config.intermediate_size,
        num_experts=config.num_experts,
        norm_topk_prob=config.norm_topk_prob,
        experts_implementation=experts_implementation,
        **common,
    )


def build_hf_moe(
    config: MoEConfig,
    *,
    experts_implementation: str = "batched_mm",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> nn.Module:
    """A real ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock`` with seeded weights.

    ``device="meta"`` builds it without memory or initialisation (shape-only use).
    """
    hf_config = hf_moe_config(config, experts_implementation)
    cls = _hf_class(
        "MixtralSparseMoeBlock" if config.router_style == "mixtral" else "Qwen3MoeSparseMoeBlock"
    )
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        block = cls(hf_config).to(dtype)  # its default init draws from the (forked) global RNG
    if block.gate.weight.device.type != "meta":
        _load_hf_moe(block, moe_weights(config, seed, dtype))
    return block


@torch.no_grad()
def _load_hf_moe(block: nn.Module, w: dict[str, torch.Tensor]) -> None:
    block.gate.weight.copy_(w["router"])
    block.experts.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], dim=1))
    block.experts.down_proj.copy_(w["down"])


def _hf_moe_canonical(block: nn.Module) -> dict[str, torch.Tensor]:
    gate, up = block.experts.gate_up_proj.detach().chunk(2, dim=1)
    return {
        "router": block.gate.weight.detach(),
        "gate": gate,
        "up": up,
        "down": block.experts.down_proj.detach(),
    }


def copy_moe_weights(src: nn.Module, dst: nn.Module) -> None:
    """Copy weights ``src -> dst``; each is a :class:`MoEBlock` or an HF sparse MoE block.

    HF's fused ``gate_up_proj (E, 2I, H)`` is ``cat([w_gate, w_up], dim=1)`` of ours.
    """
    w = src.canonical() if isinstance(src, MoEBlock) else _hf_moe_canonical(src)
    if isinstance(dst, MoEBlock):
        dst.load_canonical(w)
    else:
        _load_hf_moe(dst, w)


def hf_attention_config(config: AttentionConfig, attn_implementation: str = "sdpa") -> Any:
    """``Qwen3Config`` (q/k norm) or ``LlamaConfig`` with our shapes and RoPE base."""
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"hf_attention_config: attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}"
        )
    tf = _transformers()
    kw = {
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)},
        "attn_implementation": attn_implementation,
    }
    return tf.Qwen3Config(**kw) if config.qk_norm else tf.LlamaConfig(**kw)


def build_hf_attention(
    config: AttentionConfig,
    *,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    module_class: str | None = None,
) -> nn.Module:
    """A real HF attention layer (``layer_idx=0``) with the seeded weights of :class:`GQADecode`.

    ``module_class`` defaults to ``"Qwen3Attention"`` (q/k norm) or ``"LlamaAttention"``;
    ``"Qwen3MoeAttention"`` (the class inside Qwen3-30B-A3B) is also accepted for q/k-norm configs.
    """
    name = module_class or ("Qwen3Attention" if config.qk_norm else "LlamaAttention")
    if name not in _HF_ATTENTION_CLASSES or (name == "LlamaAttention") == config.qk_norm:
        raise ValueError(
            f"build_hf_attention: module_class {name!r} does not fit config {config.name!r} "
            f"(qk_norm={config.qk_norm}); use one of {', '.join(_HF_ATTENTION_CLASSES)}"
        )
    hf_config = hf_attention_config(config, attn_implementation)
    cls = _hf_class(name)
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        layer = cls(hf_config, layer_idx=0).to(dtype)
    if layer.q_proj.weight.device.type != "meta":
        _load_hf_attention(layer, attention_weights(config, seed, dtype))
    return layer


@torch.no_grad()
def _load_hf_attention(layer: nn.Module, w: dict[str, torch.Tensor]) -> None:
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(layer, name).weight.copy_(w[name])
    if hasattr(layer, "q_norm"):
        layer.q_norm.weight.copy_(w["q_norm"])
        layer.k_norm.weight.copy_(w["k_norm"])


def _attention_canonical(layer: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: getattr(layer, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if getattr(layer, "q_norm", None) is not None:
        out["q_norm"] = layer.q_norm.weight.detach()
        out["k_norm"] = layer.k_norm.weight.detach()
    return out


def copy_attention_weights(src: nn.Module, dst: nn.Module) -> None:
    """Copy projection and q/k-norm weights ``src -> dst`` (:class:`GQADecode` or HF attention)."""
    w = _attention_canonical(src)
    if isinstance(dst, GQADecode):
        dst.load_canonical(w)
    else:
        _load_hf_attention(dst, w)


def cache_keyword(layer: nn.Module) -> str:
    """The keyword an HF attention's ``forward`` takes its KV cache by: ``cache`` from
    transformers 5.24 on, ``past_key_values`` before (deprecated there, removed in 5.40)."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _hf_rotary(layer: nn.Module) -> nn.Module:
    mod = importlib.import_module(type(layer).__module__)
    name = next(n for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    return getattr(mod, name)(layer.config).to(layer.q_proj.weight.device)


@torch.no_grad()
def hf_decode_step(
    layer: nn.Module,
    x: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    kv_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run an HF attention layer for one decode step with :class:`GQADecode`'s semantics.

    Builds what HF needs: a ``DynamicCache`` holding ``(past_k, past_v)``, ``position_ids`` =
    ``past_len`` (or ``kv_lengths``), cos/sin from the model's own rotary-embedding class, and —
    with ``kv_lengths`` — the mask of :func:`models.attention.kv_length_mask` (bool for sdpa,
    additive ``finfo.min`` for eager, as ``create_causal_mask`` produces).
    Returns ``(out, new_k, new_v)`` read back from the cache.
    """
    tf = _transformers()
    batch, past_len = x.shape[0], past_k.shape[-2]
    cache = tf.DynamicCache(ddp_cache_data=[(past_k.clone(), past_v.clone())])
    if kv_lengths is None:
        position_ids = torch.full((batch, 1), past_len, dtype=torch.long, device=x.device)
        mask = None
    else:
        position_ids = kv_lengths.to(torch.long)[:, None]
        mask = kv_length_mask(kv_lengths, past_len)
        if layer.config._attn_implementation == "eager":
            mask = torch.where(mask, 0.0, torch.finfo(x.dtype).min).to(x.dtype)
    cos, sin = _hf_rotary(layer)(x, position_ids)
    out, _ = layer(x, position_embeddings=(cos, sin), attention_mask=mask, **{cache_keyword(layer): cache})
    return out, cache.layers[0].keys, cache.layers[0].values
