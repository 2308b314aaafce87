"""Seeded, deterministic initial values for every parameter of the layers in this package.

One canonical set of tensors per layer kind, drawn from a private ``torch.Generator`` in a fixed
order, so that the same ``(config, seed)`` gives bit-identical weights to our modules and to the
HuggingFace modules built by :mod:`models.hf` (no global RNG state is read or changed).

Scheme: every matrix ``W`` of shape ``(..., out, in)`` is ``N(0, 1/in)`` (activations stay O(1),
so numerical comparisons at ``atol=1e-5`` are meaningful); RMSNorm weights are ``1 + 0.1 N(0, 1)``
(random, so swapping the q and k norms changes the result).
"""

from __future__ import annotations

import torch

from models.configs import AttentionConfig, MoEConfig

__all__ = ["moe_weights", "attention_weights", "MOE_WEIGHT_NAMES", "ATTENTION_WEIGHT_NAMES"]

MOE_WEIGHT_NAMES = ("router", "gate", "up", "down")
ATTENTION_WEIGHT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def moe_weights(
    config: MoEConfig, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The MoE block's weights for ``seed``, on CPU.

    Returns ``{"router": (E, H), "gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}`` in
    ``dtype`` (drawn in fp32, then cast). HF stores ``gate_up_proj = cat([gate, up], dim=1)``.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    out = {
        "router": _normal(gen, (e, h), h**-0.5),
        "gate": _normal(gen, (e, i, h), h**-0.5),
        "up": _normal(gen, (e, i, h), h**-0.5),
        "down": _normal(gen, (e, h, i), i**-0.5),
    }
    return {k: v.to(dtype) for k, v in out.items()}


def attention_weights(
    config: AttentionConfig, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The attention layer's weights for ``seed``, on CPU, in ``nn.Linear`` layout ``(out, in)``.

    Keys: ``q_proj (Hq*D, H)``, ``k_proj``/``v_proj (Hkv*D, H)``, ``o_proj (H, Hq*D)`` and, for
    every variant (drawn even when unused so the projections do not depend on the variant),
    ``q_norm``/``k_norm (D,)``.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    h, d = config.hidden_size, config.head_dim
    hq, hkv = config.num_heads * d, config.num_kv_heads * d
    out = {
        "q_proj": _normal(gen, (hq, h), h**-0.5),
        "k_proj": _normal(gen, (hkv, h), h**-0.5),
        "v_proj": _normal(gen, (hkv, h), h**-0.5),
        "o_proj": _normal(gen, (h, hq), hq**-0.5),
        "q_norm": 1.0 + _normal(gen, (d,), 0.1),
        "k_norm": 1.0 + _normal(gen, (d,), 0.1),
    }
    return {k: v.to(dtype) for k, v in out.items()}
