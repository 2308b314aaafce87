"""Configurations of the real layers the project compiles, with their published numbers.

Two frozen dataclasses: :class:`MoEConfig` (a sparse Mixture-of-Experts block with SwiGLU experts)
and :class:`AttentionConfig` (grouped-query attention with rotary embeddings, one decode step).
Presets give the numbers of the released checkpoints (their ``config.json`` on the Hugging Face
Hub); ``tiny()`` shrinks a preset for tests while keeping its routing / normalisation style.

These are the workloads of the STeP evaluation (STeP §5: Mixtral-8x7B and Qwen3-30B-A3B MoE,
Qwen3-30B-A3B GQA decode) plus Llama-3-8B attention as a second GQA family without q/k norm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "MoEConfig",
    "AttentionConfig",
    "MIXTRAL_8X7B_MOE",
    "QWEN3_30B_A3B_MOE",
    "QWEN3_30B_A3B_ATTENTION",
    "LLAMA3_8B_ATTENTION",
]

RouterStyle = Literal["mixtral", "qwen3"]
AttentionVariant = Literal["qwen3", "llama"]


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse MoE block: router ``Linear(hidden -> experts)``, softmax, top-k, SwiGLU experts.

    Routing (both styles, as HuggingFace transformers 5.x computes it): ``probs = softmax(logits
    in fp32)``, ``w, idx = topk(probs, top_k)``, then ``w /= w.sum(-1)`` when ``norm_topk_prob``.
    ``router_style="mixtral"`` always renormalises and keeps ``w`` in fp32;
    ``router_style="qwen3"`` renormalises only when ``norm_topk_prob`` and casts ``w`` back to the
    activation dtype. Expert ``e`` computes ``down_e(silu(gate_e(x)) * up_e(x))``.

    Attributes:
        name: preset name, e.g. ``"mixtral-8x7b"``.
        hidden_size: model width H (elements).
        intermediate_size: expert intermediate width I (elements) — ``moe_intermediate_size`` in
            Qwen3-MoE configs, ``intermediate_size`` in Mixtral configs.
        num_experts: E, routed experts.
        top_k: experts chosen per token (``num_experts_per_tok``).
        norm_topk_prob: renormalise the top-k probabilities to sum to one.
        router_style: ``"mixtral"`` or ``"qwen3"`` (see above).
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    router_style: RouterStyle = "mixtral"

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            if getattr(self, field) < 1:
                raise ValueError(
                    f"MoEConfig {self.name!r}: {field} must be >= 1, got {getattr(self, field)}"
                )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig {self.name!r}: top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "choose top_k <= num_experts"
            )
        if self.router_style not in ("mixtral", "qwen3"):
            raise ValueError(
                f"MoEConfig {self.name!r}: router_style must be 'mixtral' or 'qwen3', got {self.router_style!r}"
            )
        if self.router_style == "mixtral" and not self.norm_topk_prob:
            raise ValueError(
                f"MoEConfig {self.name!r}: Mixtral routing always renormalises the top-k weights; "
                "use router_style='qwen3' for norm_topk_prob=False"
            )

    def tiny(
        self,
        *,
        hidden_size: int = 64,
        intermediate_size: int = 32,
        num_experts: int | None = None,
        top_k: int = 2,
    ) -> MoEConfig:
        """A small copy for tests with the same routing style (8 experts unless given)."""
        return replace(
            self,
            name=f"{self.name}-tiny",
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_experts=8 if num_experts is None else num_experts,
            top_k=top_k,
        )

    @property
    def expert_param_count(self) -> int:
        """Parameters of all experts (3 matrices of I x H each), excluding the router."""
        return 3 * self.num_experts * self.intermediate_size * self.hidden_size


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Grouped-query attention with RoPE (one layer), as in HF ``Qwen3Attention``/``LlamaAttention``.

    Attributes:
        name: preset name, e.g. ``"qwen3-30b-a3b"``.
        hidden_size: model width H (elements).
        num_heads: query heads.
        num_kv_heads: key/value heads; ``num_heads`` must be a multiple.
        head_dim: elements per head (not necessarily ``hidden_size // num_heads``).
        rope_theta: RoPE base.
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3) or not (Llama).
        rms_norm_eps: epsilon of the q/k RMSNorm.
    """

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    qk_norm: bool
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(
                    f"AttentionConfig {self.name!r}: {field} must be >= 1, got {getattr(self, field)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"AttentionConfig {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"AttentionConfig {self.name!r}: RoPE needs an even head_dim, got {self.head_dim}"
            )

    @property
    def variant(self) -> AttentionVariant:
        """``"qwen3"`` when q/k are RMS-normalised per head, else ``"llama"``."""
        return "qwen3" if self.qk_norm else "llama"

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (``num_key_value_groups`` in HF)."""
        return self.num_heads // self.num_kv_heads

    def tiny(
        self,
        *,
        hidden_size: int = 64,
        num_heads: int = 8,
        num_kv_heads: int = 2,
        head_dim: int = 16,
    ) -> AttentionConfig:
        """A small copy for tests with the same variant, RoPE base and epsilon."""
        return replace(
            self,
            name=f"{self.name}-tiny",
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )


# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): hidden 4096, intermediate 14336,
# 8 local experts, 2 per token; MixtralTopKRouter renormalises the top-2 softmax probabilities.
MIXTRAL_8X7B_MOE = MoEConfig(
    name="mixtral-8x7b",
    hidden_size=4096,
    intermediate_size=14336,
    num_experts=8,
    top_k=2,
    norm_topk_prob=True,
    router_style="mixtral",
)

# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): hidden 2048, moe_intermediate_size 768,
# 128 experts, 8 per token, norm_topk_prob true.
QWEN3_30B_A3B_MOE = MoEConfig(
    name="qwen3-30b-a3b",
    hidden_size=2048,
    intermediate_size=768,
    num_experts=128,
    top_k=8,
    norm_topk_prob=True,
    router_style="qwen3",
)

# Qwen3-30B-A3B attention: config.json sets head_dim 128 explicitly (q_proj 2048 -> 4096), rope_theta
# 1e6, rms_norm_eps 1e-6. Note: transformers' Qwen3MoeConfig has no head_dim field, so a config built
# from class defaults falls back to hidden/heads = 64 (the STeP artifact's GQA sweep uses 64).
QWEN3_30B_A3B_ATTENTION = AttentionConfig(
    name="qwen3-30b-a3b",
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1_000_000.0,
    qk_norm=True,
    rms_norm_eps=1e-6,
)

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): hidden 4096, 32 heads, 8 KV heads,
# head_dim 4096/32 = 128, rope_theta 500000, rms_norm_eps 1e-5 (only used by the layer norms,
# not by attention itself).
LLAMA3_8B_ATTENTION = AttentionConfig(
    name="llama-3-8b",
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500_000.0,
    qk_norm=False,
    rms_norm_eps=1e-5,
)
