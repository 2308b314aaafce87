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

__all__ = [
    "compile_config",
    "from_hf_config",
    "served_dtype",
    "same_structure",
    "stack_from_config",
    "stack_from_model",
]


def _config(config: Any) -> Any:
    from models.decoder import hf_config
    from models.errors import ModelConfigError

    try:
        return hf_config(config)
    except ModelConfigError as exc:
        raise FrontendError(str(exc)) from None


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def served_dtype(cfg: Any, dtype: str | None = None) -> Any:
    """The torch dtype a config's layers are built, timed and counted in: ``dtype``
    (``bf16``, ``fp16`` or ``fp32``) when given, else the dtype the config says the model is
    served in (its ``dtype`` / ``torch_dtype``), else float32 (what transformers loads a
    config without one in)."""
    import torch

    if dtype is not None:
        if dtype not in _DTYPE_NAMES:
            raise FrontendError(f"dtype {dtype!r}: choose from {', '.join(_DTYPE_NAMES)}")
        return getattr(torch, _DTYPE_NAMES[dtype])
    said = getattr(cfg, "dtype", None)  # transformers >= 4.56; older ones keep torch_dtype
    if said is None:
        said = vars(cfg).get("torch_dtype")
    if isinstance(said, str):
        said = getattr(torch, said.removeprefix("torch."), None)
    if said in (torch.bfloat16, torch.float16, torch.float32):
        return said
    return torch.float32


def _cast(inputs: tuple[Any, ...], dt: Any) -> tuple[Any, ...]:
    return tuple(x.to(dt) if x.is_floating_point() else x for x in inputs)


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
    config: Any,
    *,
    batch: int = 2,
    past: int = 8,
    name: str | None = None,
    check: bool = True,
    dtype: str | None = None,
) -> LayerGraph:
    """Raise layer 0 of ``config`` (a ``config.json`` path, dict or transformers config) as a
    decode step ``(x, past_k, past_v) -> (out, new_k, new_v)`` at full size on the meta device.

    ``batch``/``past`` only size the example (both stay dynamic in the graph); ``check``
    raises a small random stand-in first (see the module docstring), in the same dtype;
    ``dtype``: see :func:`served_dtype` (default: the one the config is served in)."""
    from models.decoder import decode_inputs, decoder_step, standin_config
    from torch2step.frontend.torch_import import from_torch

    cfg = _config(config)
    dt = served_dtype(cfg, dtype)
    label = name or f"{cfg.model_type}_decoder"
    small = None
    if check:
        tiny = standin_config(cfg)
        step = decoder_step(tiny, device="cpu").to(dt)
        small = from_torch(step, _cast(decode_inputs(tiny, 2, 4), dt), name=label)
    step = decoder_step(cfg, device="meta").to(dt)
    ins = _cast(decode_inputs(cfg, batch, past, device="meta"), dt)
    graph = from_torch(step, ins, name=label)
    if small is not None:
        why = same_structure(graph, small)
        if why is not None:
            raise FrontendError(
                f"{label}: the full-size {type(step.layer).__name__} does not raise like its "
                f"small stand-in ({why}); the checks that need numbers cannot vouch for it. "
                "Compile the module with real weights instead."
            )
    return graph


def stack_from_config(
    config: Any, layers: int | None = None, *, check: bool = True, dtype: str | None = None
) -> LayerGraph:
    """The decode step of ``layers`` decoder layers of ``config`` (default: all of the
    config's) as one :class:`~torch2step.layers.stack.Repeat` of the raised layer 0, hidden
    states in and out (the embedding and LM head are excluded)::

        (x [B, 1, H], past_k [N, B, Hkv, L, D], past_v [N, ...]) -> (out, new_k, new_v)

    Every layer is built on the meta device and compared with layer 0
    (:func:`~torch2step.layers.stack.check_identical`): a config whose layers differ (dense
    and MoE layers mixed, sliding-window layers) is refused naming the first that differs.
    ``dtype``: see :func:`served_dtype`."""
    import torch

    from models.decoder import _layer_class
    from torch2step.layers.stack import check_identical, stack_graph

    cfg = _config(config)
    count = int(layers if layers is not None else cfg.num_hidden_layers)
    if count < 1:
        raise FrontendError(f"layers={count}: a model needs at least one layer")
    with torch.device("meta"):
        cls = _layer_class(cfg)
        check_identical([cls(cfg, i) for i in range(count)], f"{cfg.model_type} ({count} layers)")
    body = from_hf_config(cfg, check=check, dtype=dtype)
    g = stack_graph(body, count, name=f"{cfg.model_type}_decoder_x{count}")
    g.notes.append(f"{count} identical {cls.__name__}s share one body (no embedding, no LM head)")
    return g


def stack_from_model(model: Any, example_past: int = 4) -> LayerGraph:
    """An HF ``*Model`` / ``*ForCausalLM`` with weights as a decode step of its layers: one
    :class:`~torch2step.layers.stack.Repeat` whose body is layer 0 raised
    (:class:`models.decoder.DecoderStep`) and whose ``layer_params`` are every layer's weights
    as its raise derives them (each layer is raised for its weights: the frontend derives
    some, e.g. stacked expert matrices);
    hidden states in and out (embedding, final norm and LM head excluded).  Layers that are not
    identical are refused naming the first that differs."""
    from models.decoder import DecoderStep, decode_inputs
    from torch2step.frontend.torch_import import from_torch
    from torch2step.layers.stack import check_identical, stack_graph

    base = model.model if hasattr(model, "lm_head") else model
    layers = list(base.layers)
    cfg = _config(model.config)
    check_identical(layers, f"{type(model).__name__} ({len(layers)} layers)")
    steps = [DecoderStep(layer, base.rotary_emb).eval() for layer in layers]
    ins = decode_inputs(cfg, 2, example_past)
    body = from_torch(steps[0], ins, name=f"{cfg.model_type}_decoder")
    weights = [body.params]
    for i, step in enumerate(steps[1:], start=1):  # raised: some weights are derived (experts)
        params = from_torch(step, ins, name=body.name).params
        if {k: tuple(t.shape) for k, t in params.items()} != {
            k: tuple(t.shape) for k, t in body.params.items()
        }:
            raise FrontendError(f"{body.name}: layer {i} raises to other weights than layer 0")
        weights.append(params)
    return stack_graph(body, len(layers), layer_params=weights)


def compile_config(
    config: Any,
    *,
    batch: int = 64,
    past: int | None = None,
    kv_lengths: Any = None,
    chip: Any = "step-sda",
    check: bool = True,
    layers: int | None = None,
    dtype: str | None = None,
    **options: Any,
) -> Any:
    """Compile layer 0 of a HuggingFace config (``config.json`` path, dict or config object)
    as a decode step at full size with no weights; returns a
    :class:`~torch2step.program.Program` whose example inputs are shapes only.

    ``report()`` times it (stand-in values for the weights, see
    :mod:`torch2step.layers.standins`); ``run()`` says it needs weights.  ``kv_lengths``
    (``batch`` lengths) makes the caches ragged (``past`` defaults to their maximum, else
    1024); ``options`` are compile options as for :func:`torch2step.compile`.  ``layers=N``
    compiles the decode step of ``N`` identical layers (:func:`stack_from_config`) into a
    :class:`~torch2step.stack_program.StackProgram`: one body, lowered once.  ``dtype``
    (``bf16``, ``fp16``, ``fp32``): what the layers are built, timed and counted in; default
    the dtype the config says the model is served in (:func:`served_dtype`)."""
    import numpy as np
    import torch

    from models.decoder import decode_inputs
    from torch2step.api import compile as compile_graph

    cfg = _config(config)
    lens = None if kv_lengths is None else np.asarray(kv_lengths, dtype=np.int64).reshape(-1)
    if lens is not None and len(lens) != batch:
        raise FrontendError(f"kv_lengths holds {len(lens)} requests but batch is {batch}")
    p = past if past is not None else (int(lens.max()) if lens is not None else 1024)
    dt = served_dtype(cfg, dtype)
    inputs = _cast(decode_inputs(cfg, batch, p, device="meta"), dt)
    if layers is not None:
        if lens is not None:
            raise FrontendError("layers=N with kv_lengths is not supported; give past instead")
        from torch2step.stack_program import compile_stack

        stack = stack_from_config(cfg, layers, check=check, dtype=dtype)
        x, k, v = inputs
        k = torch.empty((int(layers), *k.shape), device="meta", dtype=dt)
        return _with_batch(compile_stack(stack, (x, k, k.clone()), chip=chip, **options), batch)
    if lens is None:
        graph = from_hf_config(cfg, check=check, dtype=dtype)
    else:
        graph = _with_kv_lengths(cfg, f"{cfg.model_type}_decoder", check, dt)
        inputs = (*inputs, torch.as_tensor(lens))
    return _with_batch(compile_graph(graph, inputs, chip=chip, **options), batch)


def _with_batch(prog: Any, batch: int) -> Any:
    """A kernel-by-kernel program of a decode step knows its batch: its report gives the time
    per token of the batch without ``tokens=`` (a spatial program counts from its inputs)."""
    if hasattr(prog, "tokens"):
        prog.tokens = batch
    return prog


def _with_kv_lengths(cfg: Any, name: str, check: bool, dt: Any) -> LayerGraph:
    """The decode step raised with a ``kv_lengths`` input (ragged caches), in dtype ``dt``."""
    import torch

    from models.decoder import decode_inputs, decoder_step, standin_config
    from torch2step.frontend.torch_import import from_torch

    def raise_(c: Any, device: str) -> LayerGraph:
        ins = _cast(decode_inputs(c, 3, 8, device=device), dt)
        lens = torch.tensor([1, 8, 5])
        return from_torch(decoder_step(c, device=device).to(dt), (*ins, lens), name=name)

    graph = raise_(cfg, "meta")
    if check:
        why = same_structure(graph, raise_(standin_config(cfg), "cpu"))
        if why is not None:
            raise FrontendError(
                f"{name}: the full-size layer does not raise like its stand-in ({why})"
            )
    return graph
