"""Named layers for the command line and benchmarks: ``get_layer("qwen3-moe", batch=64)``.

Each entry pairs a real model's config (:mod:`models.configs`) with a module builder, example
inputs and a ``torch.export`` dynamic-shapes suggestion. Full-size layers are built on the
``meta`` device by default — shapes only, no memory, no initialisation (Mixtral-8x7B's experts are
5.6 GB per layer in fp32) — for fake-tensor capture and timing-only simulation; pass
``device="cpu"`` to allocate real weights. Tiny layers default to CPU with seeded weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from models import traces
from models.attention import ATTN_IMPLS, GQADecode
from models.configs import (
    LLAMA3_8B_ATTENTION,
    MIXTRAL_8X7B_MOE,
    QWEN3_30B_A3B_ATTENTION,
    QWEN3_30B_A3B_MOE,
    AttentionConfig,
    MoEConfig,
)
from models.errors import UnknownLayerError
from models.moe import MOE_IMPLS, MoEBlock

__all__ = ["LayerEntry", "LayerSpec", "LAYERS", "get_layer", "HF_MOE_IMPLS", "HF_CONFIGS"]

# Real HF blocks offered through the registry for MoE layers (impl "hf_<experts_implementation>").
HF_MOE_IMPLS: tuple[str, ...] = ("hf_eager", "hf_batched_mm", "hf_grouped_mm")
_INPUT_SEED_OFFSET = 1_000_003  # inputs use a different random stream than the weights


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """A registered layer: its kind, full-size config, spellings and default sizes."""

    name: str
    kind: Literal["moe", "attention", "decoder"]
    config: MoEConfig | AttentionConfig | str  # a decoder's config.json under models/hf_configs
    impls: tuple[str, ...]
    default_impl: str
    description: str
    #: folder prefix in models/traces/expert_routing (MoE layers and MoE decoder layers)
    routing_prefix: str | None = None

    @property
    def attends_kv(self) -> bool:
        """Whether the layer attends a KV cache (an attention or a decoder layer)."""
        return self.kind in ("attention", "decoder")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What :func:`get_layer` returns; unpacks as ``module, inputs, dynamic_shapes, metadata``.

    Attributes:
        name: registry name.
        module: the ``nn.Module`` (eval mode).
        example_inputs: positional inputs of ``module.forward``, on the module's device.
        dynamic_shapes: suggestion for ``torch.export.export(..., dynamic_shapes=...)`` keyed by
            argument name; a dimension whose example size is 1 is left static (export would
            specialise it anyway).
        metadata: ``kind``, ``config``, ``impl``, ``device``, ``dtype``, ``tiny``, ``seed``,
            ``param_count``, ``param_bytes`` and, per kind, ``tokens`` / ``routing_trace``
            (MoE) or ``batch``, ``past_len``, ``kv_lengths`` (int64 numpy or None) /
            ``kv_trace`` (attention). The real KV lengths are here even on ``meta``.
    """

    name: str
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    dynamic_shapes: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.module, self.example_inputs, self.dynamic_shapes, self.metadata))


LAYERS: dict[str, LayerEntry] = {
    "mixtral-moe": LayerEntry(
        "mixtral-moe",
        "moe",
        MIXTRAL_8X7B_MOE,
        MOE_IMPLS + HF_MOE_IMPLS,
        "grouped",
        "Mixtral-8x7B sparse MoE block: 8 SwiGLU experts (4096 -> 14336), top-2",
        "mixtral",
    ),
    "qwen3-moe": LayerEntry(
        "qwen3-moe",
        "moe",
        QWEN3_30B_A3B_MOE,
        MOE_IMPLS + HF_MOE_IMPLS,
        "grouped",
        "Qwen3-30B-A3B sparse MoE block: 128 SwiGLU experts (2048 -> 768), top-8",
        "qwen",
    ),
    "qwen3-gqa": LayerEntry(
        "qwen3-gqa",
        "attention",
        QWEN3_30B_A3B_ATTENTION,
        ATTN_IMPLS,
        "sdpa",
        "Qwen3-30B-A3B GQA decode step: 32 q heads, 4 KV heads, head_dim 128, q/k RMSNorm",
    ),
    "llama-gqa": LayerEntry(
        "llama-gqa",
        "attention",
        LLAMA3_8B_ATTENTION,
        ATTN_IMPLS,
        "sdpa",
        "Llama-3-8B GQA decode step: 32 q heads, 8 KV heads, head_dim 128",
    ),
    "llama-decoder": LayerEntry(
        "llama-decoder",
        "decoder",
        "llama-3-8b.json",
        ("hf",),
        "hf",
        "Llama-3-8B decoder layer (HF LlamaDecoderLayer): RMSNorm, GQA 32/8 heads, SwiGLU MLP",
    ),
    "qwen3-decoder": LayerEntry(
        "qwen3-decoder",
        "decoder",
        "qwen3-8b.json",
        ("hf",),
        "hf",
        "Qwen3-8B decoder layer (HF Qwen3DecoderLayer): GQA 32/8 heads with q/k RMSNorm, SwiGLU",
    ),
    "mixtral-decoder": LayerEntry(
        "mixtral-decoder",
        "decoder",
        "mixtral-8x7b.json",
        ("hf",),
        "hf",
        "Mixtral-8x7B decoder layer (HF MixtralDecoderLayer): GQA 32/8 heads, 8 experts top-2",
        "mixtral",
    ),
    "qwen3-moe-decoder": LayerEntry(
        "qwen3-moe-decoder",
        "decoder",
        "qwen3-30b-a3b.json",
        ("hf",),
        "hf",
        "Qwen3-30B-A3B decoder layer (HF Qwen3MoeDecoderLayer): GQA 32/4, 128 experts top-8",
        "qwen",
    ),
}

#: Where the decoder entries' ``config.json`` files live.
HF_CONFIGS = Path(__file__).parent / "hf_configs"


def _dim(name: str, size: int) -> Any:
    return torch.export.Dim(name, min=1) if size >= 2 else None


def _dims(spec: dict[int, Any]) -> dict[int, Any] | None:
    kept = {k: v for k, v in spec.items() if v is not None}
    return kept or None


def get_layer(
    name: str,
    *,
    tiny: bool = False,
    batch: int | None = None,
    kv_len: int | None = None,
    kv_lengths: str | np.ndarray | torch.Tensor | None = None,
    seed: int = 0,
    impl: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> LayerSpec:
    """Build a registered layer with example inputs.

    Args:
        name: one of ``LAYERS`` (``mixtral-moe``, ``qwen3-moe``, ``qwen3-gqa``, ``llama-gqa``).
        tiny: use ``config.tiny()`` (hidden 64, 8 experts top-2; 8 q heads, 2 KV heads, head_dim 16).
        batch: MoE tokens (input ``(batch, 1, hidden)``, default 64) or decode requests (default
            ``len(kv_lengths)`` or 4).
        kv_len: cache rows ``P`` of ``past_k``/``past_v`` (default ``max(kv_lengths)`` or 32 tiny /
            1024 full-size); must be ``>= max(kv_lengths)``.
        kv_lengths: attention only: a trace name (``"b64/med"``), a path, or an int array; adds the
            ``kv_lengths`` input (see :class:`models.attention.GQADecode`).
        seed: weights (and, from a separate stream, example inputs).
        impl: MoE ``grouped|loop|dense|gather|hf_eager|hf_batched_mm|hf_grouped_mm`` (default
            ``grouped``: it captures in about a second at full size, ``loop`` in about a minute);
            attention ``sdpa|eager``.
        device: default ``"cpu"`` when ``tiny`` else ``"meta"`` (shapes only).

    Raises:
        UnknownLayerError: unknown ``name`` (a ``KeyError``), message lists the valid names.
        ValueError: an ``impl`` the layer does not offer, or inconsistent sizes.
    """
    if name not in LAYERS:
        raise UnknownLayerError(f"unknown layer {name!r}; valid names: {', '.join(LAYERS)}")
    for what, value in (("batch", batch), ("kv_len", kv_len)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"get_layer({name!r}): {what} must be a positive integer; got {value!r}")
    entry = LAYERS[name]
    impl = entry.default_impl if impl is None else impl
    if impl not in entry.impls:
        raise ValueError(
            f"layer {name!r} has no impl {impl!r}; choose one of {', '.join(entry.impls)}"
        )
    device = torch.device(device if device is not None else ("cpu" if tiny else "meta"))
    if entry.kind == "decoder":
        return _get_decoder(entry, tiny, batch, kv_len, kv_lengths, seed, dtype, device)
    assert not isinstance(entry.config, str)
    config = entry.config.tiny() if tiny else entry.config
    gen = torch.Generator().manual_seed(int(seed) + _INPUT_SEED_OFFSET)

    def rand(*shape: int) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    meta: dict[str, Any] = {
        "kind": entry.kind,
        "config": config,
        "impl": impl,
        "device": str(device),
        "dtype": dtype,
        "tiny": tiny,
        "seed": seed,
    }
    if entry.kind == "moe":
        assert isinstance(config, MoEConfig)
        if kv_len is not None or kv_lengths is not None:
            raise ValueError(f"layer {name!r} is an MoE block: kv_len / kv_lengths do not apply")
        tokens = 64 if batch is None else batch
        module = _build_moe(config, impl, seed, dtype, device)
        inputs: tuple[torch.Tensor, ...] = (rand(tokens, 1, config.hidden_size),)
        dynamic = {"hidden_states": _dims({0: _dim("tokens", tokens)})}
        trace = f"{entry.routing_prefix}_b{tokens}"
        meta.update(
            tokens=tokens, routing_trace=trace if trace in traces.list_traces()["routing"] else None
        )
    else:
        assert isinstance(config, AttentionConfig)
        lens, trace_name = _resolve_kv_lengths(kv_lengths)
        b = (len(lens) if lens is not None else 4) if batch is None else batch
        if lens is not None and len(lens) != b:
            raise ValueError(f"layer {name!r}: batch={b} but kv_lengths has {len(lens)} entries")
        default_p = 32 if tiny else 1024
        p = kv_len if kv_len is not None else (int(lens.max()) if lens is not None else default_p)
        if lens is not None and (lens.min() < 0 or lens.max() > p):
            raise ValueError(
                f"layer {name!r}: kv_lengths must lie in [0, kv_len={p}], got max {lens.max()}"
            )
        module = GQADecode(config, attn=impl, seed=seed, dtype=dtype, device=device)  # type: ignore[arg-type]
        hkv, d = config.num_kv_heads, config.head_dim
        inputs = (rand(b, 1, config.hidden_size), rand(b, hkv, p, d), rand(b, hkv, p, d))
        bd, pd = _dim("batch", b), _dim("past", p)
        dynamic = {
            "x": _dims({0: bd}),
            "past_k": _dims({0: bd, 2: pd}),
            "past_v": _dims({0: bd, 2: pd}),
        }
        if lens is not None:
            inputs = (*inputs, torch.as_tensor(lens, dtype=torch.int64).to(device))
            dynamic["kv_lengths"] = _dims({0: bd})
        meta.update(batch=b, past_len=p, kv_lengths=lens, kv_trace=trace_name)
    module.eval()
    n_params = sum(t.numel() for t in module.parameters())
    meta.update(
        param_count=n_params, param_bytes=n_params * torch.empty((), dtype=dtype).element_size()
    )
    return LayerSpec(name, module, inputs, dynamic, meta)


def _build_moe(
    config: MoEConfig, impl: str, seed: int, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    if impl.startswith("hf_"):
        from models.hf import build_hf_moe

        return build_hf_moe(
            config, experts_implementation=impl[3:], seed=seed, dtype=dtype, device=device
        )
    return MoEBlock(config, impl=impl, seed=seed, dtype=dtype, device=device)  # type: ignore[arg-type]


def _resolve_kv_lengths(
    kv_lengths: str | np.ndarray | torch.Tensor | None,
) -> tuple[np.ndarray | None, str | None]:
    if kv_lengths is None:
        return None, None
    if isinstance(kv_lengths, str):
        return traces.kv_lengths(kv_lengths), kv_lengths
    arr = np.asarray(kv_lengths.cpu() if isinstance(kv_lengths, torch.Tensor) else kv_lengths)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"kv_lengths must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64), None


def _get_decoder(
    entry: LayerEntry,
    tiny: bool,
    batch: int | None,
    kv_len: int | None,
    kv_lengths: str | np.ndarray | torch.Tensor | None,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LayerSpec:
    """A whole HF decoder layer as a decode step (:class:`models.decoder.DecoderStep`)."""
    from models.decoder import decode_inputs, decoder_step, hf_config, standin_config

    assert isinstance(entry.config, str)
    config = hf_config(HF_CONFIGS / entry.config)
    if tiny:
        config = standin_config(config)
    lens, trace_name = _resolve_kv_lengths(kv_lengths)
    b = (len(lens) if lens is not None else 4) if batch is None else batch
    p = (
        kv_len
        if kv_len is not None
        else (int(lens.max()) if lens is not None else (32 if tiny else 1024))
    )
    module = decoder_step(config, device=device, seed=seed).to(dtype)
    dev = "meta" if device.type == "meta" else "cpu"
    inputs = decode_inputs(
        config, b, p, seed=seed + _INPUT_SEED_OFFSET, device=dev, kv_lengths=lens
    )
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    bd, pd = _dim("batch", b), _dim("past", p)
    dynamic = {
        "x": _dims({0: bd}),
        "past_k": _dims({0: bd, 2: pd}),
        "past_v": _dims({0: bd, 2: pd}),
    }
    if lens is not None:
        dynamic["kv_lengths"] = _dims({0: bd})
    n_params = sum(t.numel() for t in module.parameters())
    meta: dict[str, Any] = {
        "kind": "decoder", "config": config, "impl": "hf", "device": str(device), "dtype": dtype,
        "tiny": tiny, "seed": seed, "batch": b, "past_len": p, "kv_lengths": lens,
        "kv_trace": trace_name, "param_count": n_params,
        "param_bytes": n_params * torch.empty((), dtype=dtype).element_size(),
    }  # fmt: skip
    if entry.routing_prefix is not None:  # a MoE decoder layer: one token per request
        trace = f"{entry.routing_prefix}_b{b}"
        meta.update(
            tokens=b, routing_trace=trace if trace in traces.list_traces()["routing"] else None
        )
    return LayerSpec(entry.name, module, inputs, dynamic, meta)
