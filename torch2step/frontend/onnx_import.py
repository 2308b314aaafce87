"""ONNX import: an ONNX model (file or ``onnx.ModelProto``) -> :class:`~torch2step.layers.LayerGraph`.

The pipeline is one readable function of named steps (as torch.fx pass pipelines):

1. ``load``: read and check the model (``onnx.checker``), infer shapes (``onnx.shape_inference``);
2. ``OnnxView.build``: topological order, symbolic shapes; dynamic input dims (``dim_param``)
   become sympy symbols registered in ``LayerGraph.dims``;
3. ``fold_constants``: weights, constant expressions and symbolic shape arithmetic;
4. ``raise_patterns``: the named patterns of :data:`PATTERNS` (MoE routing and experts,
   attention, rotary embedding, RMSNorm, linear) claim subgraphs by meaning;
5. translate what is live and left over one-to-one (:data:`~torch2step.frontend.onnx_translate.
   TRANSLATORS`); every node that cannot be translated is collected into ONE
   :class:`~torch2step.errors.UnsupportedOperatorError` (as TVM Relax's frontends do);
6. drop dead layer nodes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx

from torch2step.errors import FrontendError, UnsupportedOperatorError
from torch2step.frontend.onnx_attention import ATTENTION_PATTERNS
from torch2step.frontend.onnx_emit import Emitter, Unsupported
from torch2step.frontend.onnx_fold import fold_constants
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.onnx_moe import MOE_PATTERNS
from torch2step.frontend.onnx_norms import NORM_PATTERNS
from torch2step.frontend.onnx_patterns import Match, Pattern, RaiseResult, raise_patterns
from torch2step.frontend.onnx_rotary import ROTARY_PATTERNS
from torch2step.frontend.onnx_translate import TRANSLATORS
from torch2step.layers import LayerGraph, TensorType

__all__ = ["import_onnx", "load_onnx_model", "PATTERNS"]

#: Raising patterns, tried in this order (larger meanings first).
PATTERNS: tuple[Pattern, ...] = (
    *MOE_PATTERNS,
    *ATTENTION_PATTERNS,
    *ROTARY_PATTERNS,
    *NORM_PATTERNS,
)

log = logging.getLogger(__name__)

_TWO_GB = 2**31

#: What to do about op types that commonly remain unsupported.
_HINTS = {
    "NonZero": "data-dependent indexing outside a recognised MoE block",
    "ScatterND": "scatter outside a recognised MoE block",
    "GatherND": "gather by run-time indices outside a recognised MoE block",
    "TopK": "top-k outside a recognised MoE router (softmax + TopK [+ normalise])",
    "Loop": "control flow: export without data-dependent Python loops",
    "If": "control flow: export without data-dependent branches (use torch.cond or remove them)",
    "Expand": "broadcast copy outside repeat_kv of grouped-query attention",
    "Cos": "trigonometry outside a recognised rotary embedding",
    "Shape": "the size of a data-dependent tensor (only sizes of inputs are known)",
    "Sin": "trigonometry outside a recognised rotary embedding",
}


def _infer_shapes(model: onnx.ModelProto, where: str) -> onnx.ModelProto:
    """``model`` with inferred shapes.  Inference runs in strict mode so that a conflict (a
    declared shape the operators contradict, an op it cannot type) is reported as a warning
    naming the error; the import then goes on with what non-strict inference (or, failing
    that, the exporter) recorded, and a value whose shape stays unknown is a FrontendError
    naming it later."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises several unrelated classes here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        log.warning(
            "ONNX shape inference reports an error in %s (%s: %s); importing with the shapes "
            "it could still infer and those the exporter recorded",
            where,
            type(exc).__name__,
            first,
        )
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - already reported above
        return model


def load_onnx_model(source: str | os.PathLike[str] | onnx.ModelProto) -> onnx.ModelProto:
    """Read ``source``, check it and infer its shapes; raises :class:`FrontendError` for a
    missing, unreadable or invalid model."""
    if isinstance(source, onnx.ModelProto):
        model, where = source, "the given ModelProto"
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        where = str(path)
        if not path.exists():
            raise FrontendError(
                f"ONNX file {where} does not exist; check the path or export the model first "
                "(torch.onnx.export(model, args, path, dynamo=True))"
            )
        if not path.is_file():
            raise FrontendError(f"{where} is not a file; pass the path of an .onnx model")
        try:
            model = onnx.load(str(path))
        except Exception as exc:  # protobuf decode errors have no common base class
            raise FrontendError(
                f"cannot parse {where} as an ONNX model ({type(exc).__name__}: {exc}); the file "
                "is corrupt or not ONNX — re-export it with torch.onnx.export(..., dynamo=True)"
            ) from exc
    else:
        raise FrontendError(
            f"import_onnx expects a file path or an onnx.ModelProto, got {type(source).__name__}"
        )
    if not model.HasField("graph") or not model.graph.output:
        raise FrontendError(
            f"{where} holds no ONNX graph with outputs (empty, truncated or not an ONNX file); "
            "re-export the model"
        )
    if model.ByteSize() < _TWO_GB:
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise FrontendError(
                f"{where} is not a valid ONNX model: {first}; re-export it or repair it so that "
                "onnx.checker.check_model passes"
            ) from exc
        model = _infer_shapes(model, where)
    return model


def import_onnx(
    source: str | os.PathLike[str] | onnx.ModelProto,
    *,
    name: str | None = None,
    patterns: tuple[Pattern, ...] | None = None,
) -> LayerGraph:
    """Import an ONNX model as a layer graph (see the module docstring for the steps).

    ``source`` is a path or an ``onnx.ModelProto``; ``name`` names the graph (default: the graph
    name in the file); ``patterns`` replaces :data:`PATTERNS` (e.g. ``()`` to see the graph
    without raising).
    """
    model = load_onnx_model(source)
    view = OnnxView.build(model)
    folded = fold_constants(view)
    raised = raise_patterns(view, PATTERNS if patterns is None else patterns)
    graph = LayerGraph(name=name or model.graph.name or "onnx")
    for inp in view.inputs:
        shape = tuple(d for d in view.shapes[inp] if d is not None)  # all known after build
        graph.add_input(inp, TensorType(shape, view.dtypes.get(inp, "fp32")))
    em = Emitter(view, graph)
    for inp in view.inputs:
        em.bind(inp, inp)
    problems = _translate(view, raised, folded, em)
    if problems:
        raise UnsupportedOperatorError(_report(graph.name, problems, raised))
    graph.outputs = [_output(em, o) for o in view.outputs]
    graph.single_output = len(graph.outputs) == 1
    _drop_dead(graph)
    return graph


def _output(em: Emitter, value: str) -> str:
    try:
        return em.get(value)
    except KeyError:
        raise FrontendError(f"graph output {value!r} was not computed") from None


def _live(view: OnnxView, raised: RaiseResult, folded: set[str]) -> tuple[set[str], set[int]]:
    """Names of the nodes needed for the graph outputs, and ids of the live matches."""
    live: set[str] = set()
    live_matches: set[int] = set()
    stack = list(view.outputs)
    seen: set[str] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = view.producer.get(v)
        if p is None:
            continue
        m = raised.claimed.get(p.name)
        if m is not None:
            if id(m) not in live_matches:
                live_matches.add(id(m))
                live |= m.nodes
                stack.extend(m.inputs)
        elif p.name not in live:
            live.add(p.name)
            if p.name not in folded:
                stack.extend(x for x in p.inputs if x)
    return live, live_matches


def _translate(
    view: OnnxView, raised: RaiseResult, folded: set[str], em: Emitter
) -> list[tuple[OnnxNode, str]]:
    live, live_matches = _live(view, raised, folded)
    last: dict[int, int] = {}
    for m in raised.matches:
        last[id(m)] = max(view.by_name[n].index for n in m.nodes)
    problems: list[tuple[OnnxNode, str]] = []
    for node in view.nodes:
        if node.name not in live:
            continue
        m: Match | None = raised.claimed.get(node.name)
        if m is not None:
            if id(m) in live_matches and node.index == last[id(m)]:
                missing = [i for i in m.inputs if not em.has(i)]
                if missing and not problems:
                    problems.append((m.anchor, f"{m.pattern}: inputs {missing} were not computed"))
                if not missing:
                    try:
                        m.emit(em)
                    except Unsupported as exc:
                        problems.append((m.anchor, f"{m.pattern}: {exc.reason}"))
            continue
        if node.name in folded:
            continue  # known before run time
        fn = TRANSLATORS.get(node.op_type) if node.domain == "" else None
        blocked = not all(em.has(i) for i in node.inputs if i)  # downstream of a problem
        if blocked and fn is not None:
            continue
        if fn is None:
            dom = f" (domain {node.domain!r})" if node.domain else ""
            hint = _HINTS.get(node.op_type, "no layer op or raising pattern covers it")
            problems.append((node, f"no translation for {node.op_type}{dom}: {hint}"))
            continue
        try:
            fn(em, node)
        except Unsupported as exc:
            problems.append((node, exc.reason))
        except FrontendError as exc:
            problems.append((node, str(exc)))
    return problems


def _report(name: str, problems: list[tuple[OnnxNode, str]], raised: RaiseResult) -> str:
    lines = [
        f"ONNX model {name!r}: {len(problems)} operation(s) cannot be imported into the layer graph:"
    ]
    lines += [f"  - {node.source}: {why}" for node, why in problems]
    if raised.notes:
        lines.append("Raising patterns that recognised part of the graph but did not apply:")
        lines += [f"  - {pat} at {where}: {why}" for pat, where, why in raised.notes]
    lines.append(
        "What to do: export MoE experts with HF experts_implementation='batched_mm', or "
        "'grouped_mm' with torch.onnx.export(..., custom_translation_table="
        "torch2step.frontend.onnx_export.grouped_mm_translation_table()), or as a per-expert "
        "loop; attention as sdpa/eager (opset 20) or the opset-23 Attention op, with a causal or "
        "kv_lengths mask; otherwise add a translator to "
        "torch2step.frontend.onnx_translate.TRANSLATORS or a pattern to "
        "torch2step.frontend.onnx_import.PATTERNS."
    )
    return "\n".join(lines)


def _drop_dead(graph: LayerGraph) -> None:
    needed = set(graph.outputs)
    keep = []
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs):
            keep.append(node)
            needed.update(node.inputs)
    graph.nodes = keep[::-1]
    for p in [p for p in graph.params if p not in needed]:
        del graph.params[p]
    live = set(graph.inputs) | set(graph.params) | {o for n in graph.nodes for o in n.outputs}
    for v in [v for v in graph.types if v not in live]:
        del graph.types[v]
