"""Capturing a PyTorch module as a core-ATen graph with symbolic shapes (``torch.export``), the
first stage of the pipeline (README, "The pipeline").

``capture`` runs ``torch.export.export(..., strict=False,
prefer_deferred_runtime_asserts_over_guards=True)`` (non-strict tracing works on HuggingFace
layers; without the flag a dynamic KV length fails on matmul-style attention) and then
``run_decompositions`` with ``aten.scaled_dot_product_attention`` kept whole, so attention stays
one op (``torch.fx.symbolic_trace`` fails on HF attention; non-strict ``torch.export`` with deferred runtime asserts is the capture path).

Dynamic dims.  Without ``dynamic_shapes`` every tensor argument gets ``Dim.AUTO`` on the axes
that vary in practice (the heuristic of :func:`default_dynamic_axes`): tokens ``T`` of ``[T, H]``
activations, batch ``B`` and sequence ``S`` of ``[B, S, H]`` activations, batch ``B`` and KV
length ``L`` of ``[B, H, L, D]`` KV caches, batch (and sequence) of integer inputs such as
``kv_lengths[B]`` or ``positions[B, S]``.  Axes of size 0 or 1 in the example stay static
(``torch.export`` specialises them), so give examples with sizes >= 2 on the axes that vary, or
pass ``dynamic_shapes`` (``torch.export.Dim`` names become the layer graph's dim names).

Errors are :class:`~torch2step.errors.FrontendError` naming what to change: an HF MoE block
with ``eager`` experts (export stops at its data-dependent loop: use ``batched_mm`` or
``grouped_mm``), example inputs that do not fit the module (the submodule, its weight shapes and
the shapes given), data-dependent Python control flow (the user line and ``torch.cond``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from torch2step.errors import FrontendError

__all__ = [
    "capture",
    "default_dynamic_axes",
    "default_dynamic_shapes",
    "dim_names",
    "eager_experts",
]

log = logging.getLogger(__name__)

#: Key of ``ExportedProgram.graph_module.meta`` holding what capture chose for the user (a
#: fallback the report lists among its notes).
NOTES_KEY = "torch2step_notes"

_TORCH_DIR = os.path.dirname(torch.__file__)
_QUIET = (
    "torch",
    "torch._subclasses.fake_tensor",
    "torch._export.non_strict_utils",
    "torch.export",
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
)


def default_dynamic_axes(t: torch.Tensor) -> dict[int, str]:
    """The axes of an example tensor treated as dynamic by default, with their dim names."""
    r = t.dim()
    if t.dtype.is_floating_point:
        axes = {2: {0: "T"}, 3: {0: "B", 1: "S"}, 4: {0: "B", 2: "L"}}.get(
            r, {0: "B"} if r > 4 else {}
        )
    else:
        axes = {1: {0: "B"}, 2: {0: "B", 1: "S"}}.get(r, {0: "B"} if r >= 3 else {})
    return {a: n for a, n in axes.items() if t.shape[a] >= 2}


def default_dynamic_shapes(example_inputs: Sequence[Any], named: bool = True) -> tuple[Any, ...]:
    """``dynamic_shapes`` for ``torch.export`` from :func:`default_dynamic_axes`.

    ``named``: axes with the same heuristic name and example size share one ``Dim`` (the batch
    of every input, the KV length of ``past_k`` and ``past_v``), so the graph has one ``B`` and
    one ``L``; otherwise every axis is ``Dim.AUTO`` (export decides, nothing is shared)."""
    dims: dict[tuple[str, int], Any] = {}
    out: list[Any] = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            out.append(None)
            continue
        spec = {}
        for a, name in default_dynamic_axes(x).items():
            key = (name, int(x.shape[a]))
            if named and key not in dims:
                suffix = "" if not any(k[0] == name for k in dims) else str(len(dims))
                dims[key] = Dim(name + suffix)
            spec[a] = dims[key] if named else Dim.AUTO
        out.append(spec)
    return tuple(out)


def _arg_names(module: nn.Module, n: int) -> list[str]:
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = []
    return (params + [f"arg{i}" for i in range(len(params), n)])[:n]


def dim_names(
    module: nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any = None
) -> dict[tuple[int, int], str]:
    """``(input index, axis) -> name``: ``torch.export.Dim`` names from ``dynamic_shapes``,
    else the heuristic names (``T``, ``B``, ``S``, ``L``)."""
    names: dict[tuple[int, int], str] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            for a, n in default_dynamic_axes(x).items():
                names[(i, a)] = n
    specs: list[Any] = []
    if isinstance(dynamic_shapes, Mapping):
        arg_names = _arg_names(module, len(example_inputs))
        specs = [dynamic_shapes.get(a) for a in arg_names]
    elif isinstance(dynamic_shapes, (list, tuple)):
        specs = list(dynamic_shapes)
    for i, spec in enumerate(specs):
        items = spec.items() if isinstance(spec, Mapping) else enumerate(spec or ())
        for axis, d in items:
            name = getattr(d, "__name__", None)
            if isinstance(name, str) and name not in ("AUTO", "DYNAMIC", "STATIC"):
                names[(i, int(axis))] = name
    return names


def eager_experts(module: nn.Module) -> list[str]:
    """Submodules that are HF experts blocks running the ``eager`` (Python loop) code."""
    found = []
    for name, sub in module.named_modules():
        cfg = getattr(sub, "config", None)
        if cfg is None or not hasattr(cfg, "_experts_implementation"):
            continue
        if type(sub).__name__.endswith("Experts") and cfg._experts_implementation in (
            None,
            "eager",
        ):
            found.append(name or type(sub).__name__)
    return found


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Scope torch.export's own chatter to the export call: its loggers (which print the partial
    graph on data-dependent errors; the :class:`FrontendError` raised instead names the user
    line) and its FutureWarnings / UserWarnings, restored on exit.  The process's stderr and
    its warning filters outside the call are left alone."""
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def _unaliased(example_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of example inputs sharing memory with an earlier one: torch.export merges aliased
    inputs, and the graph would then read one input for both (e.g. ``k`` for ``v``)."""
    seen: set[int] = set()
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.numel():
            ptr = x.untyped_storage().data_ptr()
            if ptr in seen:
                x = x.clone()
            seen.add(x.untyped_storage().data_ptr())
        out.append(x)
    return tuple(out)


def _check_inputs(module: nn.Module, example_inputs: Sequence[Any]) -> None:
    for i, x in enumerate(example_inputs):
        if not isinstance(x, (torch.Tensor, int, float, bool, type(None))):
            raise FrontendError(
                f"example input {i} is a {type(x).__name__}; pass tensors only. A KV cache object "
                "(DynamicCache) cannot pass through torch.export: write the decode step "
                "tensor-in/tensor-out (x, past_k, past_v) -> (out, new_k, new_v) and cat the "
                "past and new K/V yourself"
            )
    _check_hidden(module, example_inputs)
    _check_dtypes(module, example_inputs)
    try:
        inspect.signature(module.forward).bind(*example_inputs)
    except TypeError as exc:
        sig = inspect.signature(module.forward)
        raise FrontendError(
            f"{type(module).__name__}.forward{sig} does not take {len(example_inputs)} "
            f"positional example inputs ({exc}); pass example_inputs in forward's order"
        ) from None
    except ValueError:
        pass


def _check_dtypes(module: nn.Module, example_inputs: Sequence[Any]) -> None:
    """Floating inputs in the dtype of the module's (floating) parameters."""
    dtypes = {p.dtype for p in module.parameters() if p.dtype.is_floating_point}
    if len(dtypes) != 1:
        return
    (want,) = dtypes
    names = _arg_names(module, len(example_inputs))
    for name, x in zip(names, example_inputs):
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.dtype != want:
            raise FrontendError(
                f"example input {name!r} is {str(x.dtype).removeprefix('torch.')} but the "
                f"parameters of {type(module).__name__} are "
                f"{str(want).removeprefix('torch.')}; pass inputs of the parameters' dtype "
                f"(x.to({want}))"
            )


def _check_hidden(module: nn.Module, example_inputs: Sequence[Any]) -> None:
    """A HuggingFace layer takes ``hidden_states[..., config.hidden_size]`` first."""
    if not type(module).__module__.startswith("transformers.") or not example_inputs:
        return
    x = example_inputs[0]
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() == 0:
        return
    for name, sub in module.named_modules():
        hidden = getattr(getattr(sub, "config", None), "hidden_size", None)
        if isinstance(hidden, int):
            if x.shape[-1] != hidden:
                where = f"{name}.config" if name else "config"
                raise FrontendError(
                    f"{type(module).__name__} expects hidden states [..., {hidden}] "
                    f"({where}.hidden_size = {hidden}) as its first input; got "
                    f"{list(x.shape)}. Pass example inputs of the module's hidden size."
                )
            return


def _user_frame(tb: Any) -> str | None:
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if os.path.basename(f.filename) != "capture.py"]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _failing_module(module: nn.Module, tb: Any) -> tuple[str, nn.Module] | None:
    names = {id(m): n for n, m in module.named_modules()}
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            found = (names[id(obj)] or type(obj).__name__, obj)
        tb = tb.tb_next
    return found


def _describe(name: str, mod: nn.Module) -> str:
    if isinstance(mod, nn.Linear):
        return (
            f"{name} (nn.Linear, weight [{mod.out_features}, {mod.in_features}] "
            f"{str(mod.weight.dtype).removeprefix('torch.')}) expects inputs [..., {mod.in_features}]"
        )
    params = ", ".join(
        f"{p} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for p, t in mod.named_parameters(recurse=False)
    )
    kind = type(mod).__name__
    if not params and name == kind:
        return name
    return f"{name} ({kind}{': ' + params if params else ''})"


def _shapes(example_inputs: Sequence[Any]) -> str:
    return ", ".join(
        f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
        if isinstance(x, torch.Tensor)
        else repr(x)
        for x in example_inputs
    )


def _explain(exc: BaseException, module: nn.Module, example_inputs: Sequence[Any]) -> FrontendError:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = _user_frame(exc.__traceback__)
    at = f" at {where}" if where else ""
    cls = type(module).__name__
    text = str(exc)
    data_dependent = "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__
    eager = eager_experts(module)
    if eager:
        return FrontendError(
            f"torch.export cannot capture {cls}: its experts ({', '.join(eager)}) use the 'eager' "
            "implementation, a Python loop over the experts hit by the example, which stops "
            f"export on a data-dependent guard ({msg}){at}. Switch the experts to 'batched_mm' "
            "or 'grouped_mm': build the config with experts_implementation='batched_mm' (or set "
            "config._experts_implementation = 'grouped_mm' before building the block), or call "
            "model.set_experts_implementation('batched_mm') on a full model."
        )
    if data_dependent:
        return FrontendError(
            f"torch.export cannot capture {cls}: Python control flow depends on tensor values "
            f"({msg}){at}. Express it with tensor ops (torch.where, index_add_, masks) or "
            "torch.cond instead of `if`/loops over data (e.g. `if tokens.numel() == 0`)."
        )
    failing = _failing_module(module, exc.__traceback__)
    if isinstance(exc, (RuntimeError, TypeError, ValueError, IndexError)) and failing is not None:
        name, mod = failing
        return FrontendError(
            f"the example inputs do not fit {cls}: {_describe(name, mod)}, but the inputs given "
            f"are [{_shapes(example_inputs)}] and it fails with: {msg}{at}. Pass example inputs "
            "of the shapes and dtype the module expects."
        )
    return FrontendError(
        f"torch.export could not capture {cls} with inputs [{_shapes(example_inputs)}]: "
        f"{type(exc).__name__}: {msg}{at}"
    )


def capture(
    module: nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any = None
) -> torch.export.ExportedProgram:
    """``torch.export`` ``module`` on ``example_inputs`` and decompose to core ATen, keeping
    ``scaled_dot_product_attention`` whole.  ``dynamic_shapes`` as for ``torch.export.export``;
    None uses :func:`default_dynamic_shapes`.  Raises :class:`FrontendError` on failure."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = _unaliased(tuple(example_inputs))
    _check_inputs(module, example_inputs)
    was_training = module.training
    module.eval()
    try:
        if dynamic_shapes is not None:
            return _export(module, example_inputs, dynamic_shapes)
        try:
            return _export(module, example_inputs, default_dynamic_shapes(example_inputs))
        except _ConstraintsViolated as exc:
            # the module fixes some heuristic dim: let export decide axis by axis, and say so
            note = (
                f"capture: the default dynamic dims of {type(module).__name__} "
                f"({_heuristic_dims(module, example_inputs)}) contradict the module, so "
                "torch.export chose axis by axis (Dim.AUTO) and may have made some static; "
                "pass dynamic_shapes to choose ("
                + (str(exc).splitlines()[0][:300] if str(exc) else "constraints violated")
                + ")"
            )
            log.warning("%s", note)
            ep = _export(module, example_inputs, default_dynamic_shapes(example_inputs, False))
            ep.graph_module.meta.setdefault(NOTES_KEY, []).append(note)
            return ep
    finally:
        module.train(was_training)


def _heuristic_dims(module: nn.Module, example_inputs: Sequence[Any]) -> str:
    names = _arg_names(module, len(example_inputs))
    return ", ".join(
        f"{names[i]}[{a}]={n}"
        for i, x in enumerate(example_inputs)
        if isinstance(x, torch.Tensor)
        for a, n in default_dynamic_axes(x).items()
    )


class _ConstraintsViolated(FrontendError):
    """The requested dynamic dims contradict the module (torch's suggested fixes inside)."""


def _no_fake_cache() -> contextlib.AbstractContextManager[Any]:
    """FakeTensor's dispatch cache off (for a trace of symbolic sizes, :func:`_export`)."""
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)


def _export(
    module: nn.Module, example_inputs: tuple[Any, ...], dynamic_shapes: Any
) -> torch.export.ExportedProgram:
    with _quiet():
        try:
            # FakeTensor's dispatch cache does not pay for itself in these traces of
            # symbolic sizes: making its entries and re-creating outputs from them (sympy
            # sizes and strides) costs more than computing the outputs again (about 0.7 s of
            # a decoder layer's 3 s capture); the graph traced is the same
            with torch.no_grad(), _no_fake_cache():
                ep = torch.export.export(
                    module,
                    example_inputs,
                    dynamic_shapes=dynamic_shapes,
                    strict=False,
                    prefer_deferred_runtime_asserts_over_guards=True,
                )
        except Exception as exc:  # noqa: BLE001 - every export failure becomes a FrontendError
            if "Constraints violated" in str(exc):
                raise _ConstraintsViolated(
                    f"the dynamic dims given for {type(module).__name__} contradict the module: "
                    f"{str(exc).split('The error above')[0].strip()}"
                ) from None
            raise _explain(exc, module, example_inputs) from None
        table = torch.export.default_decompositions()
        table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
        try:
            # the decomposition traces the exported graph again: without the cache too (about
            # 0.4 s of a 1.3 s decomposition of an attention layer, 0.8 s of a decoder's)
            with _no_fake_cache():
                return ep.run_decompositions(table)
        except Exception as exc:  # noqa: BLE001
            raise FrontendError(
                f"decomposing the captured {type(module).__name__} to core ATen failed: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            ) from None
