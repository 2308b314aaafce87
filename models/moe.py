"""Sparse Mixture-of-Experts block (Mixtral / Qwen3-MoE), written four ways.

The STeP evaluation (STeP §5.1-5.2) runs these blocks with per-token expert choices from real
traces; the compiler must recognise one meaning behind several spellings, so :class:`MoEBlock`
offers the spellings that occur in real code (``impl``):

- ``"loop"``: ``for e in range(E)``: ``torch.where(indices == e)``, gather the tokens, run the
  expert, ``index_add_`` into the output. No data-dependent Python ``if``, so it exports with
  ``torch.export`` (non-strict) with one unbacked size per expert.
- ``"dense"``: every expert on every token (``einsum`` over stacked weights), weighted by the
  ``(tokens, experts)`` routing matrix built with ``scatter`` (zero for unchosen experts).
- ``"gather"``: index the stacked expert weights by the chosen ids (``W[indices]`` of shape
  ``(tokens, top_k, ...)``, as gpt-fast's MoE does) and contract per token with ``einsum``.
- ``"grouped"``: HF's ``grouped_mm`` experts (transformers 5.x ``grouped_mm_experts_forward``):
  ``sort`` the ``tokens * top_k`` expert ids, per-expert offsets from ``histc`` + ``cumsum``, one
  grouped matmul per projection over the sorted rows (:func:`grouped_mm`), SwiGLU, the inverse
  permutation, and a sum over the ``top_k`` slots. No per-expert Python loop in the traced
  program, so ``torch.export`` captures it in 1-2 s at full size (``"loop"`` traces 128 experts one
  by one, about a minute), and the frontend raises it with its ``moe_grouped_mm`` pattern.

All four compute exactly HuggingFace's ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``
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

__all__ = ["MoEBlock", "MOE_IMPLS", "MoEImpl", "GROUPED_MM_OP", "grouped_mm"]

MoEImpl = Literal["loop", "dense", "gather", "grouped"]
MOE_IMPLS: tuple[str, ...] = ("loop", "dense", "gather", "grouped")

GROUPED_MM_OP = "torch2step::grouped_mm"
"""Qualified name of :func:`grouped_mm` (``torch.ops.torch2step.grouped_mm`` in a captured graph)."""


@torch.library.custom_op(GROUPED_MM_OP, mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped matrix product: rows ``offs[g-1]:offs[g]`` of ``input`` times ``weight[g]``.

    ``input (S, K)`` holds rows sorted by group, ``weight (G, K, N)``, ``offs (G,)`` the int32 or
    int64 running row counts (``offs[-1] <= S``; rows past it are zero). Returns ``(S, N)`` in
    ``input``'s dtype. The semantics of ``torch.nn.functional.grouped_mm`` with 2-D ``input`` and
    3-D ``weight``, which ``torch.export`` cannot capture outside bf16 (its fake kernel checks the
    dtype); this op works for every dtype and device, with a shape-only fake kernel, as
    transformers' ``grouped_mm_fallback``.
    """
    out = input.new_zeros(input.shape[0], weight.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync for all groups
        if end > start:
            torch.mm(input[start:end], weight[g], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    torch._check(
        input.dim() == 2 and weight.dim() == 3 and offs.dim() == 1,
        lambda: (
            f"grouped_mm: want input (S, K), weight (G, K, N), offs (G,); got "
            f"{tuple(input.shape)}, {tuple(weight.shape)}, {tuple(offs.shape)}"
        ),
    )
    torch._check(
        input.shape[1] == weight.shape[1] and offs.shape[0] == weight.shape[0],
        lambda: (
            f"grouped_mm: input {tuple(input.shape)}, weight {tuple(weight.shape)} and offs "
            f"{tuple(offs.shape)} disagree on K or the number of groups"
        ),
    )
    return input.new_empty(input.shape[0], weight.shape[2])


def _grouped_mm_backward(
    ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, None]:
    input, weight, offs = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_input = grouped_mm(grad, weight.transpose(1, 2), offs)
    grad_weight = torch.zeros_like(weight)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            grad_weight[g] = input[start:end].T @ grad[start:end]
        start = end
    return grad_input, grad_weight, None


def _grouped_mm_setup(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
) -> None:
    ctx.save_for_backward(*inputs)


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


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
        elif self.impl == "grouped":
            out = self._grouped(flat, weights, indices)
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

    def _grouped(
        self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """HF ``grouped_mm_experts_forward``: the ``S = T * k`` (token, slot) pairs sorted by
        expert, each expert's SwiGLU on its contiguous rows, then back to token order."""
        t, k = indices.shape
        e = self.config.num_experts
        ids_sorted, perm = torch.sort(indices.reshape(-1))
        x = flat[perm // k]  # (S, H), grouped by expert
        w = weights.reshape(-1)[perm]  # (S,)
        # histc counts in fp32 on every device (exact below 2**24 rows); ids lie in [0, E)
        counts = torch.histc(ids_sorted.float(), bins=e, min=0, max=e - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate = grouped_mm(x, self.w_gate.transpose(-2, -1), offs)
        up = grouped_mm(x, self.w_up.transpose(-2, -1), offs)
        y = grouped_mm(F.silu(gate) * up, self.w_down.transpose(-2, -1), offs)  # (S, H)
        y = y * w.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.shape[0], device=perm.device)
        return y[inv].view(t, k, flat.shape[-1]).sum(dim=1).to(flat.dtype)
