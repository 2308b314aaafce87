"""Whole HuggingFace decoder layers as tensor-in / tensor-out decode steps, built from a config
object or a ``config.json`` file alone, with weights or on the ``meta`` device (shapes only).

A :class:`DecoderStep` wraps one ``*DecoderLayer`` (Llama, Qwen3, Qwen3-MoE, Mixtral, OLMoE;
Starcoder2 and Phi with their LayerNorms and biased projections)::

    (x [B, 1, H], past_k [B, Hkv, P, D], past_v [B, Hkv, P, D][, kv_lengths [B]])
        -> (out, new_k, new_v)

with the layer's own norms, attention, rotary embedding (positions ``P``, the cache length) and
MLP or MoE block.  With ``kv_lengths`` the caches are ragged (request ``b`` holds
``kv_lengths[b]`` rows, right-padded to ``P``): its new token sits at position
``kv_lengths[b]`` and sees its cached rows and itself.  The cache update is ``cat([past, new], -2)`` (what ``DynamicCache.update``
does).  MoE experts run HF's ``batched_mm`` implementation (``eager`` stops ``torch.export``).

:func:`hf_config` reads a config (a ``config.json`` path, a dict or a config object);
:func:`decoder_step` builds the step, tiny or at full size, on any device.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.errors import ModelConfigError
from models.hf import _transformers, cache_keyword

__all__ = [
    "DECODER_LAYERS",
    "DecoderStep",
    "hf_config",
    "decoder_step",
    "decode_inputs",
    "tiny_config",
    "tiny_config_dict",
    "standin_config",
    "ModelStep",
    "model_step",
    "model_inputs",
    "model_dynamic_shapes",
]

#: ``model_type`` -> the decoder layer class raised whole.
DECODER_LAYERS: dict[str, str] = {
    "llama": "LlamaDecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
    "qwen3_moe": "Qwen3MoeDecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "olmoe": "OlmoeDecoderLayer",
    "starcoder2": "Starcoder2DecoderLayer",
    "phi": "PhiDecoderLayer",
}


def hf_config(config: Any) -> Any:
    """A transformers config from a ``config.json`` path, a dict or a config object; MoE
    experts set to ``batched_mm`` and attention to ``sdpa``."""
    tf = _transformers()
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelConfigError(f"cannot read the HF config {path}: {exc}") from None
    if isinstance(config, dict):
        kind = config.get("model_type")
        if kind not in DECODER_LAYERS:
            raise ModelConfigError(
                f"model_type {kind!r} is not a raised decoder family; supported: "
                f"{', '.join(sorted(DECODER_LAYERS))}"
            )
        fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
        config = tf.AutoConfig.for_model(kind, **fields)
    kind = getattr(config, "model_type", None)
    if kind not in DECODER_LAYERS:
        raise ModelConfigError(
            f"model_type {kind!r} is not a raised decoder family; supported: "
            f"{', '.join(sorted(DECODER_LAYERS))}"
        )
    config._attn_implementation = "sdpa"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "batched_mm"
    return config


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A small config of ``model_type`` (hidden 64, 4 query / 2 KV heads of 16, 4 experts)."""
    return hf_config(tiny_config_dict(model_type, **overrides))


def tiny_config_dict(model_type: str, **overrides: Any) -> dict[str, Any]:
    """:func:`tiny_config` as the fields of a HuggingFace ``config.json``."""
    base: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "rms_norm_eps": 1e-6,
    }
    if model_type in ("qwen3_moe", "mixtral", "olmoe"):
        experts = {"mixtral": "num_local_experts"}.get(model_type, "num_experts")
        base.update({experts: 4, "num_experts_per_tok": 2})
        if model_type == "qwen3_moe":
            base.update(moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1)
    base.update(overrides)
    return base


def _field(cfg: Any, *names: str) -> Any:
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)


def standin_config(config: Any) -> Any:
    """A small config of the same structure as ``config``: hidden 64, head dim 16, query
    heads 4 with the same grouping kind (MHA / GQA / MQA), at most 8 experts, the same top-k,
    routing normalisation, norms, activation and RoPE base."""
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


def _layer_class(config: Any) -> type[nn.Module]:
    kind = config.model_type
    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    return getattr(mod, DECODER_LAYERS[kind])


def _rotary_class(config: Any) -> type[nn.Module]:
    kind = config.model_type
    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    name = next(n for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_"))
    return getattr(mod, name)


class _TensorCache:
    """What an HF attention calls on its cache: ``update`` concatenates past and new."""

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.past_k, self.past_v = past_k, past_v
        self.k = self.v = past_k

    def update(self, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.k = torch.cat([self.past_k, k], dim=-2)
        self.v = torch.cat([self.past_v, v], dim=-2)
        return self.k, self.v


class DecoderStep(nn.Module):
    """One decode step of an HF decoder layer, tensors in and out (see the module docstring)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(
        self,
        x: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        kv_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, past = x.shape[0], x.shape[1], past_k.shape[2]
        mask = None
        if t > 1:  # prefill: causal over the new tokens, after the whole cache
            i = torch.arange(t, device=x.device)[:, None]
            j = torch.arange(past + t, device=x.device)[None, :]
            causal = j <= past + i  # [T, P + T]
        if kv_lengths is None:
            positions = (torch.arange(t, device=x.device) + past).expand(b, t)
            if t > 1:
                mask = causal[None, None]
        else:  # ragged caches right-padded to P: request b holds kv_lengths[b] rows
            positions = kv_lengths[:, None] + torch.arange(t, device=x.device)
            j = torch.arange(past + t, device=x.device)
            new = (j >= past)[None, :] if t == 1 else causal[None] & (j >= past)
            cached = (j[None, :] < kv_lengths[:, None])[:, None, :]  # [B, 1, P + T]
            mask = (cached | new)[:, None] if t > 1 else (cached[:, 0] | new)[:, None, None, :]
        cos, sin = self.rotary(x, positions)
        cache = _TensorCache(past_k, past_v)
        out = self.layer(
            x, position_embeddings=(cos, sin), attention_mask=mask,
            **{cache_keyword(self.layer.self_attn): cache},
        )  # fmt: skip
        if isinstance(out, tuple):  # older transformers return (hidden_states, ...)
            out = out[0]
        return out, cache.k, cache.v


def decoder_step(
    config: Any, *, device: str | torch.device = "meta", seed: int | None = 0
) -> DecoderStep:
    """A :class:`DecoderStep` of layer 0 of ``config`` (see :func:`hf_config`) on ``device``;
    on a real device every parameter is drawn from ``seed`` (HF leaves experts uninitialised
    and some routers at zeros).  ``meta`` builds shapes only: no memory, no initialisation."""
    cfg = hf_config(config)
    device = torch.device(device)
    with device:
        layer = _layer_class(cfg)(cfg, 0)
        rotary = _rotary_class(cfg)(cfg)
    step = DecoderStep(layer, rotary).eval()
    if device.type != "meta" and seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(layer.named_parameters()):
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return step


def decode_inputs(
    config: Any,
    batch: int,
    past: int,
    *,
    seed: int = 0,
    device: str = "cpu",
    kv_lengths: Any = None,
) -> tuple[torch.Tensor, ...]:
    """Random ``(x, past_k, past_v)`` for a :class:`DecoderStep` of ``config``, and
    ``kv_lengths`` (int64, each in ``[0, past]``) appended when given."""
    if kv_lengths is not None:
        lens = torch.as_tensor(kv_lengths, dtype=torch.int64)
        if lens.shape != (batch,) or int(lens.min()) < 0 or int(lens.max()) > past:
            raise ModelConfigError(
                f"kv_lengths must be {batch} lengths in [0, {past}]; got {lens.tolist()}"
            )
        return (*decode_inputs(config, batch, past, seed=seed, device=device), lens.to(device))
    cfg = hf_config(config)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.num_key_value_heads, past, d)
    if device == "meta":
        x = torch.empty(batch, 1, cfg.hidden_size, device="meta")
        return x, torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
    return (
        torch.randn(batch, 1, cfg.hidden_size, generator=gen),
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen),
    )


def _model_class(config: Any, causal_lm: bool) -> type[nn.Module]:
    kind = config.model_type
    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    layer = DECODER_LAYERS[kind].removesuffix("DecoderLayer")
    return getattr(mod, f"{layer}ForCausalLM" if causal_lm else f"{layer}Model")


class ModelStep(nn.Module):
    """One decode step of an HF ``*Model`` / ``*ForCausalLM`` of ``N`` layers, tensors in and
    out::

        (ids [B, 1], past_k [N, B, Hkv, P, D], past_v [N, B, Hkv, P, D])
            -> (logits [B, 1, V] or hidden [B, 1, H], new_k_0, new_v_0, ..., new_k_N-1, new_v_N-1)

    the model's own embedding, layers (each with its cache ``past_k[l]``), final norm, rotary
    embedding and, for ``*ForCausalLM``, LM head (``lm_head=False`` excludes it)."""

    def __init__(self, model: nn.Module, lm_head: bool = True) -> None:
        super().__init__()
        self.model = model
        self.use_head = lm_head and hasattr(model, "lm_head")

    def forward(self, ids: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor) -> Any:
        base = self.model.model if hasattr(self.model, "lm_head") else self.model
        b, past = ids.shape[0], past_k.shape[3]
        h = base.embed_tokens(ids)
        positions = torch.full((b, 1), past, dtype=torch.long, device=ids.device)
        cos, sin = base.rotary_emb(h, positions)
        caches = []
        for i, layer in enumerate(base.layers):
            cache = _TensorCache(past_k[i], past_v[i])
            out = layer(
                h, position_embeddings=(cos, sin), attention_mask=None,
                **{cache_keyword(layer.self_attn): cache},
            )  # fmt: skip
            h = out[0] if isinstance(out, tuple) else out
            caches += [cache.k, cache.v]
        norm = base.norm if hasattr(base, "norm") else base.final_layernorm  # Phi's name
        h = norm(h)
        return (self.model.lm_head(h) if self.use_head else h, *caches)


def model_step(
    config: Any,
    *,
    layers: int | None = None,
    causal_lm: bool = True,
    lm_head: bool = True,
    device: str | torch.device = "meta",
    seed: int | None = 0,
) -> ModelStep:
    """A :class:`ModelStep` of ``config``'s ``*ForCausalLM`` (or ``*Model``) with ``layers``
    layers (default: the config's), seeded like :func:`decoder_step` on a real device."""
    cfg = hf_config(config)
    if layers is not None:
        cfg.num_hidden_layers = layers
    device = torch.device(device)
    with device:
        model = _model_class(cfg, causal_lm)(cfg)
    step = ModelStep(model, lm_head).eval()
    if device.type != "meta" and seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return step


def model_inputs(
    config: Any, batch: int, past: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(ids, past_k, past_v)`` for a :class:`ModelStep` of ``config``."""
    cfg = hf_config(config)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, past, d)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    return ids, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def model_dynamic_shapes() -> tuple[dict[int, Any], ...]:
    """``dynamic_shapes`` of a :class:`ModelStep`: batch ``B`` and KV length ``L`` (the layer
    axis of the stacked caches stays static)."""
    from torch.export import Dim

    b, p = Dim("B"), Dim("L")
    return ({0: b}, {1: b, 3: p}, {1: b, 3: p})
