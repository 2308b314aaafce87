"""Grouped-query attention, one decode step, tensor-in / tensor-out (Qwen3 and Llama variants).

The GQA decode workload of the STeP evaluation (STeP §5.3: Qwen3-30B-A3B decode over a batch
of requests whose KV-cache lengths come from the Azure trace). The step is written so that
``torch.export`` sees only tensors (measured: a ``DynamicCache`` argument breaks
``run_decompositions``): ``forward(x, past_k, past_v, kv_lengths=None) -> (out, new_k, new_v)``.

Computation (exactly HF ``Qwen3Attention`` / ``LlamaAttention`` of transformers 5.x for one new
token): ``q, k, v = q_proj(x), k_proj(x), v_proj(x)`` split into heads; Qwen3 applies per-head
RMSNorm to q and k; RoPE (rotate-half form, base ``rope_theta``) at the new token's position;
``new_k = cat([past_k, k], dim=-2)`` (same for v); attention of the ``num_heads`` query heads
over the ``num_kv_heads`` shared KV heads, scale ``head_dim ** -0.5``; ``o_proj``.

Positions and masking:

- ``kv_lengths=None``: every request's cache is full; the new token has position
  ``P = past_k.shape[-2]`` and attends to all ``P + 1`` rows of ``new_k``. No mask.
- ``kv_lengths`` (int64, shape ``(batch,)``, each ``0 <= L_b <= P``): request ``b``'s valid cache
  is rows ``[0, L_b)`` of ``past_k[b]`` (rows ``L_b .. P-1`` are padding). The new token gets RoPE
  position ``L_b``, is still appended at row ``P`` of ``new_k`` (the cache is a right-padded
  buffer and ``cat`` appends after the padding), and attends to rows ``j`` with
  ``j < L_b or j == P``: ``L_b + 1`` keys. Values are not checked inside ``forward`` (that would
  be a data-dependent branch); :func:`kv_length_mask` gives the mask.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.configs import AttentionConfig
from models.init import attention_weights

__all__ = [
    "GQADecode",
    "RMSNorm",
    "ATTN_IMPLS",
    "AttnImpl",
    "rope_inv_freq",
    "rope_cos_sin",
    "rotate_half",
    "repeat_kv",
    "kv_length_mask",
]

AttnImpl = Literal["sdpa", "eager"]
ATTN_IMPLS: tuple[str, ...] = ("sdpa", "eager")


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32 (HF ``Qwen3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE inverse frequencies ``theta ** (-2i / head_dim)``, shape ``(head_dim // 2,)``, fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``(*positions.shape, head_dim)`` for integer ``positions`` (HF rotary)."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` of the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(B, Hkv, L, D) -> (B, Hkv * n_rep, L, D)``, each KV head repeated for its query group."""
    if n_rep == 1:
        return x
    b, hkv, length, d = x.shape
    return x[:, :, None, :, :].expand(b, hkv, n_rep, length, d).reshape(b, hkv * n_rep, length, d)


def kv_length_mask(kv_lengths: torch.Tensor, past_len: int) -> torch.Tensor:
    """Bool ``(B, 1, 1, past_len + 1)``: row ``j`` is visible to request ``b`` iff
    ``j < kv_lengths[b]`` or ``j == past_len`` (the new token)."""
    j = torch.arange(past_len + 1, device=kv_lengths.device)
    allowed = (j[None, :] < kv_lengths[:, None]) | (j[None, :] == past_len)
    return allowed[:, None, None, :]


class GQADecode(nn.Module):
    """One decode step of GQA; see the module docstring for the exact semantics.

    Args:
        config: the attention shape; ``config.qk_norm`` selects Qwen3 (True) or Llama (False).
        attn: ``"sdpa"`` (``F.scaled_dot_product_attention``, ``enable_gqa=True`` when there is no
            mask, ``repeat_kv`` + boolean ``attn_mask`` otherwise) or ``"eager"`` (``repeat_kv`` +
            matmul + additive mask + fp32 softmax + matmul, as HF's eager attention).
        seed: every parameter is drawn from it (:func:`models.init.attention_weights`).
        device: ``"meta"`` builds shapes only (no memory, no init) for full-size configs.

    ``forward(x (B, 1, H), past_k (B, Hkv, P, D), past_v (B, Hkv, P, D), kv_lengths=None)``
    returns ``(out (B, 1, H), new_k (B, Hkv, P + 1, D), new_v (B, Hkv, P + 1, D))``.
    """

    def __init__(
        self,
        config: AttentionConfig,
        *,
        attn: AttnImpl = "sdpa",
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if attn not in ATTN_IMPLS:
            raise ValueError(
                f"GQADecode: unknown attn {attn!r}; choose one of {', '.join(ATTN_IMPLS)}"
            )
        self.config = config
        self.attn = attn
        self.scaling = config.head_dim**-0.5
        h, d = config.hidden_size, config.head_dim
        device = torch.device("cpu" if device is None else device)
        kw = {"device": device, "dtype": dtype}
        # skip_init: no draw from the global RNG; the seeded values are written below.
        linear = nn.utils.skip_init
        self.q_proj = linear(nn.Linear, h, config.num_heads * d, bias=False, **kw)
        self.k_proj = linear(nn.Linear, h, config.num_kv_heads * d, bias=False, **kw)
        self.v_proj = linear(nn.Linear, h, config.num_kv_heads * d, bias=False, **kw)
        self.o_proj = linear(nn.Linear, config.num_heads * d, h, bias=False, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, **kw)
        self.register_buffer(
            "inv_freq", rope_inv_freq(d, config.rope_theta).to(device=device), persistent=False
        )
        if self.q_proj.weight.device.type != "meta":
            self.load_canonical(attention_weights(config, seed, dtype))

    @torch.no_grad()
    def load_canonical(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy the tensors of :func:`models.init.attention_weights` into this layer."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).weight.copy_(weights[name])
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.weight.copy_(weights["q_norm"])
            self.k_norm.weight.copy_(weights["k_norm"])

    def _heads(self, t: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        b, s, _ = t.shape
        t = t.view(b, s, -1, self.config.head_dim)
        if norm is not None:
            t = norm(t)
        return t.transpose(1, 2)  # (B, heads, 1, D)

    def forward(
        self,
        x: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        kv_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != cfg.hidden_size:
            raise ValueError(
                f"GQADecode: x must be (batch, 1, {cfg.hidden_size}), got {tuple(x.shape)}; "
                "decode takes one new token per request"
            )
        if (
            past_k.dim() != 4
            or past_k.shape[1] != cfg.num_kv_heads
            or past_k.shape[3] != cfg.head_dim
        ):
            raise ValueError(
                f"GQADecode: past_k must be (batch, {cfg.num_kv_heads}, past_len, {cfg.head_dim}), "
                f"got {tuple(past_k.shape)}"
            )
        past_len = past_k.shape[-2]
        q = self._heads(self.q_proj(x), self.q_norm)
        k = self._heads(self.k_proj(x), self.k_norm)
        v = self._heads(self.v_proj(x), None)

        if kv_lengths is None:
            positions = torch.arange(past_len, past_len + 1, device=x.device)[None, :]  # (1, 1)
        else:
            positions = kv_lengths[:, None]  # (B, 1)
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)
        cos, sin = cos[:, None], sin[:, None]  # (B|1, 1, 1, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        new_k = torch.cat([past_k, k], dim=-2)
        new_v = torch.cat([past_v, v], dim=-2)
        mask = None if kv_lengths is None else kv_length_mask(kv_lengths, past_len)
        if self.attn == "sdpa":
            o = self._sdpa(q, new_k, new_v, mask)
        else:
            o = self._eager(q, new_k, new_v, mask)
        o = o.transpose(1, 2).reshape(x.shape[0], 1, cfg.num_heads * cfg.head_dim)
        return self.o_proj(o), new_k, new_v

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, scale=self.scaling, enable_gqa=True)
        n_rep = self.config.num_groups
        return F.scaled_dot_product_attention(
            q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask, scale=self.scaling
        )

    def _eager(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        n_rep = self.config.num_groups
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if mask is not None:
            scores = scores + torch.where(mask, 0.0, torch.finfo(scores.dtype).min).to(scores.dtype)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
