"""Sparse Mixture-of-Experts block (Mixtral / Qwen3-MoE), written three ways.

The STeP evaluation (seed 000 §5.1-5.2) runs these blocks with per-token expert choices from real
traces; the compiler must recognise one meaning behind several spellings, so :class:`MoEBlock`
offers the spellings that occur in real code (``impl``):

- ``"loop"``: ``for e in range(E)``: ``torch.where(indices == e)``, gather the tokens, run the
  expert, ``index_add_`` into the output. No data-dependent Python ``if``, so it exports with
  ``torch.export`` (non-strict) with one unbacked size per expert.
- ``"dense"``: every expert on every token (``einsum`` over stacked weights), weighted by the
  ``(tokens, experts)`` routing matrix built with ``scatter`` (zero for unchosen experts).
- ``"gather"``: index the stacked expert weights by the chosen ids (``W[indices]`` of shape
  ``(tokens, top_k, ...)``, as gpt-fast's MoE does) and contract per token with ``einsum``.

All three compute exactly HuggingFace's ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``
(transformers 5.x) up to floating-point summation order; HF's block returns one tensor (no router
logits), and so does this one.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.configs import MoEConfig
from models.init import moe_weights

__all__ = ["MoEBlock", "MOE_IMPLS", "MoEImpl"]

MoEImpl = Literal["loop", "dense", "gather"]
MOE_IMPLS: tuple[str, ...] = ("loop", "dense", "gather")


class MoEBlock(nn.Module):
    """Router + top-k + SwiGLU experts; input ``(batch, seq, hidden)`` or ``(tokens, hidden)``.

    Parameters: ``router`` (``nn.Linear(H, E)``, weight ``(E, H)``), ``w_gate``/``w_up``
    ``(E, I, H)``, ``w_down`` ``(E, H, I)``. Every parameter is drawn from ``seed``
    (:func:`models.init.moe_weights`). ``device="meta"`` builds shapes only (no memory, no init):
    use it for full-size configs under fake-tensor capture or timing-only simulation.

    ``forward`` returns a tensor of the input's shape and dtype — what HF's block returns.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        impl: MoEImpl = "loop",
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if impl not in MOE_IMPLS:
            raise ValueError(
                f"MoEBlock: unknown impl {impl!r}; choose one of {', '.join(MOE_IMPLS)}"
            )
        self.config = config
        self.impl = impl
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        device = torch.device("cpu" if device is None else device)
        kw = {"device": device, "dtype": dtype}
        # skip_init: no draw from the global RNG; the seeded values are written below.
        self.router = nn.utils.skip_init(nn.Linear, h, e, bias=False, **kw)
        self.w_gate = nn.Parameter(torch.empty(e, i, h, **kw))
        self.w_up = nn.Parameter(torch.empty(e, i, h, **kw))
        self.w_down = nn.Parameter(torch.empty(e, h, i, **kw))
        if self.router.weight.device.type != "meta":
            self.load_canonical(moe_weights(config, seed, dtype))

    @torch.no_grad()
    def load_canonical(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``{"router", "gate", "up", "down"}`` tensors (see :func:`models.init.moe_weights`)."""
        self.router.weight.copy_(weights["router"])
        self.w_gate.copy_(weights["gate"])
        self.w_up.copy_(weights["up"])
        self.w_down.copy_(weights["down"])

    def canonical(self) -> dict[str, torch.Tensor]:
        """This block's weights as ``{"router", "gate", "up", "down"}`` (detached views)."""
        return {
            "router": self.router.weight.detach(),
            "gate": self.w_gate.detach(),
            "up": self.w_up.detach(),
            "down": self.w_down.detach(),
        }

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router on ``(tokens, H)``: returns ``(logits (T, E), weights (T, k), indices (T, k))``.

        softmax in fp32, then top-k, then renormalisation (HF ``MixtralTopKRouter`` /
        ``Qwen3MoeTopKRouter``). Mixtral keeps the weights in fp32; Qwen3 casts them to the
        logits' dtype.
        """
        cfg = self.config
        logits = self.router(flat)
        probs = F.softmax(logits.float(), dim=-1)
        weights, indices = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if cfg.router_style == "qwen3":
            weights = weights.to(logits.dtype)
        return logits, weights, indices

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, self.config.hidden_size)
        _, weights, indices = self.route(flat)
        if self.impl == "loop":
            out = self._loop(flat, weights, indices)
        elif self.impl == "dense":
            out = self._dense(flat, weights, indices)
        else:
            out = self._gather(flat, weights, indices)
        return out.reshape(shape)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert ``e`` on ``x (n, H)`` -> ``(n, H)``."""
        return F.linear(
            F.silu(F.linear(x, self.w_gate[e])) * F.linear(x, self.w_up[e]), self.w_down[e]
        )

    def _loop(
        self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(flat)
        for e in range(self.config.num_experts):
            token_idx, slot = torch.where(indices == e)
            y = self._expert(e, flat[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def _dense(
        self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        gate = torch.einsum("th,eih->eti", flat, self.w_gate)
        up = torch.einsum("th,eih->eti", flat, self.w_up)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.w_down)  # (E, T, H)
        combine = torch.zeros(
            flat.shape[0], self.config.num_experts, dtype=weights.dtype, device=flat.device
        ).scatter(1, indices, weights)  # (T, E), zero where not routed
        return torch.einsum("te,eth->th", combine, y.to(combine.dtype)).to(flat.dtype)

    def _gather(
        self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        g = torch.einsum("th,tkih->tki", flat, self.w_gate[indices])
        u = torch.einsum("th,tkih->tki", flat, self.w_up[indices])
        y = torch.einsum("tki,tkhi->tkh", F.silu(g) * u, self.w_down[indices])  # (T, k, H)
        return torch.einsum("tkh,tk->th", y.to(weights.dtype), weights).to(flat.dtype)
