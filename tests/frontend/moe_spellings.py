"""A user-written loop MoE in many spellings of the same computation, for the property tests
that every spelling raises to the same layer graph.

A :class:`Spelling` chooses how the tokens of expert ``e`` are found (``torch.where(ids == e)``,
``(ids == e).nonzero()``, ``nonzero(as_tuple=True)``, ``mask.any(-1).nonzero()`` or
``torch.where(mask.any(-1))``), how they are gathered (``x[tok]``, ``x.index_select(0, tok)``,
``torch.gather``), how the routing weight is read (``w[tok, slot]`` or the masked sum
``(w * mask).sum(-1)[tok]``), how results are accumulated (``index_add_``, ``scatter_add_``,
``index_put_(accumulate=True)``), the expert MLP (gated SwiGLU/GeGLU/ReGLU or a plain two-matrix
MLP with SiLU/GELU/ReLU), whether the expert projections carry biases, and whether the experts
are 3-D parameters or an ``nn.ModuleList`` of ``nn.Linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, INTER = 32, 16

FIND = ("where", "nonzero", "nonzero_tuple", "any_nonzero", "any_where")
GATHER = ("index", "index_select", "gather")
ACCUMULATE = ("index_add_", "scatter_add_", "index_put_")
ACTIVATION = ("silu", "gelu", "relu")
_ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass(frozen=True)
class Spelling:
    find: str = "where"
    gather: str = "index"
    accumulate: str = "index_add_"
    activation: str = "silu"
    gated: bool = True
    bias: bool = False
    modules: bool = False

    @property
    def masked_weight(self) -> bool:
        """Token-level finds have no slot: the weight is the masked sum over the slots."""
        return self.find.startswith("any")


class SpelledMoE(nn.Module):
    """Router, softmax, top-k, renormalise, then ``for e in range(E)`` in ``spelling``."""

    def __init__(self, spelling: Spelling, experts: int = 4, top_k: int = 2, seed: int = 0):
        super().__init__()
        s = self.spelling = spelling
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen) * 0.2)

        with torch.no_grad():
            self.router.weight.copy_(torch.randn(experts, HIDDEN, generator=gen) * 0.2)
        # the same numbers whatever the storage, so every spelling computes the same function
        w_gate, w_up, w_down = (
            rand(experts, INTER, HIDDEN),
            rand(experts, INTER, HIDDEN),
            rand(experts, HIDDEN, INTER),
        )
        b_gate, b_up, b_down = rand(experts, INTER), rand(experts, INTER), rand(experts, HIDDEN)
        if s.modules:

            def lin(w: torch.Tensor, b: torch.Tensor) -> nn.Linear:
                m = nn.Linear(w.shape[1], w.shape[0], bias=s.bias)
                with torch.no_grad():
                    m.weight.copy_(w)
                    if s.bias:
                        m.bias.copy_(b)
                return m

            self.gate = (
                nn.ModuleList(lin(w_gate[e], b_gate[e]) for e in range(experts))
                if s.gated
                else None
            )
            self.up = nn.ModuleList(lin(w_up[e], b_up[e]) for e in range(experts))
            self.down = nn.ModuleList(lin(w_down[e], b_down[e]) for e in range(experts))
        else:
            self.w_gate = w_gate if s.gated else None
            self.w_up, self.w_down = w_up, w_down
            if s.bias:
                self.b_gate = b_gate if s.gated else None
                self.b_up, self.b_down = b_up, b_down

    def _proj(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.spelling.modules:
            return getattr(self, name)[e](x)
        b = getattr(self, "b_" + name)[e] if self.spelling.bias else None
        return F.linear(x, getattr(self, "w_" + name)[e], b)

    def expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        act = _ACT[self.spelling.activation]
        if self.spelling.gated:
            h = act(self._proj("gate", e, xs)) * self._proj("up", e, xs)
        else:
            h = act(self._proj("up", e, xs))
        return self._proj("down", e, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spelling
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            mask = idx == e
            if s.find == "where":
                tok, slot = torch.where(mask)
            elif s.find == "nonzero":
                nz = mask.nonzero()
                tok, slot = nz[:, 0], nz[:, 1]
            elif s.find == "nonzero_tuple":
                tok, slot = torch.nonzero(mask, as_tuple=True)
            elif s.find == "any_nonzero":
                tok = mask.any(-1).nonzero().squeeze(-1)
            else:
                (tok,) = torch.where(mask.any(dim=-1))
            if s.gather == "index":
                xs = x[tok]
            elif s.gather == "index_select":
                xs = x.index_select(0, tok)
            else:
                xs = torch.gather(x, 0, tok[:, None].expand(-1, x.shape[1]))
            if s.masked_weight:
                we = (w * mask).sum(-1)[tok, None]
            else:
                we = w[tok, slot, None]
            y = self.expert(e, xs) * we
            if s.accumulate == "index_add_":
                out.index_add_(0, tok, y)
            elif s.accumulate == "scatter_add_":
                out.scatter_add_(0, tok[:, None].expand(-1, y.shape[1]), y)
            else:
                out.index_put_((tok,), y, accumulate=True)
        return out
