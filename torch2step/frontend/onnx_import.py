"""ONNX import: an ONNX model (file or ``onnx.ModelProto``) -> :class:`~torch2step.layers.LayerGraph`.

The pipeline is one readable function of named steps (as torch.fx pass pipelines):

1. ``load``: read and check the model (``onnx.checker``), infer shapes (``onnx.shape_inference``);
2. ``OnnxView.build``: topological order, symbolic shapes; dynamic input dims (``dim_param``)
   become sympy symbols registered in ``LayerGraph.dims``;
3. ``fold_constants``: weights, constant expressions and symbolic shape arithmetic;
4. the raising engine shared with the PyTorch frontend (:mod:`torch2step.frontend.engine`) on
   the graph in the common view (:class:`~torch2step.frontend.onnx_nodes.OnnxNodeView`): the
   patterns of :data:`PATTERNS` (the recognisers of both frontends for MoE regions, top-k
   routing, attention, rotary embedding, RMSNorm and linear layers; ONNX spells only the expert
   projections, :mod:`~torch2step.frontend.onnx_moe_experts`) raise subgraphs by meaning, what is needed and
   left over is translated one-to-one
   (:data:`~torch2step.frontend.onnx_translate.TRANSLATORS`), and every node that cannot be
   translated is collected into ONE :class:`~torch2step.errors.UnsupportedOperatorError`;
5. drop dead layer nodes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx

from torch2step.errors import FrontendError
from torch2step.frontend.engine import raise_graph
from torch2step.frontend.fx_pattern import Pattern
from torch2step.frontend.gnode import GNode, arg_nodes
from torch2step.frontend.onnx_emit import Emitter
from torch2step.frontend.onnx_fold import fold_constants
from torch2step.frontend.onnx_graph import ONNX_DTYPES, OnnxNode, OnnxView, unknown_dims_advice
from torch2step.frontend.onnx_moe_experts import onnx_projections
from torch2step.frontend.onnx_nodes import OnnxNodeView
from torch2step.frontend.onnx_translate import TRANSLATORS
from torch2step.frontend.raise_attention import ATTENTION_MATMUL, ATTENTION_OP
from torch2step.frontend.raise_basic import (
    LAYERNORM,
    LINEAR,
    RMSNORM,
    RMSNORM_OP,
    TOPK_ROUTING,
)
from torch2step.frontend.raise_moe_region import moe_region_pattern
from torch2step.frontend.raise_rotary import ROTARY, ROTARY_OP
from torch2step.frontend.raise_rules import check_node, rule_for
from torch2step.layers import LayerGraph, TensorType

__all__ = ["import_onnx", "load_onnx_model", "PATTERNS", "OnnxFrontend"]

#: Raising patterns, tried in this order (larger meanings first).
PATTERNS: tuple[Pattern, ...] = (
    moe_region_pattern(onnx_projections),
    TOPK_ROUTING,
    ATTENTION_OP,
    ATTENTION_MATMUL,
    ROTARY_OP,
    ROTARY,
    RMSNORM,
    RMSNORM_OP,
    LAYERNORM,
    LINEAR,
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
    "Shape": "the size of a data-dependent tensor (only sizes of inputs are known)",  # _shape_hint
    "Sin": "trigonometry outside a recognised rotary embedding",
    "Softmax": "Softmax before opset 13 flattens axes; re-export with opset >= 13",
    "Transpose": "Transpose without perm of a value of unknown rank; give perm",
    **{
        op: "reduction over axes computed at run time; the axes must be constants"
        for op in ("ReduceMean", "ReduceSum", "ReduceMax")
    },
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


def _missing_external_data(path: Path) -> list[str]:
    """The external data files ``path``'s tensors name that are not next to it."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a readable model at all: no external data to name
        return []
    g = model.graph
    tensors = [*g.initializer, *(a.t for n in g.node for a in n.attribute if a.HasField("t"))]
    locations = {
        entry.value
        for t in tensors
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    return sorted(loc for loc in locations if not (path.parent / loc).is_file())


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
            missing = _missing_external_data(path)
            if missing:
                raise FrontendError(
                    f"{where} keeps its weights in external data file(s) {', '.join(missing)}, "
                    f"missing from {path.parent}; place {missing[0]} next to the model (the "
                    "location is relative to the .onnx file) or re-export it"
                ) from exc
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


#: Operators translated by the one-to-one rules of the PyTorch frontend
#: (:data:`~torch2step.frontend.raise_rules.RULES`); the others by :data:`TRANSLATORS`.
SHARED_RULES = frozenset(
    {"add", "sub", "mul", "div", "maximum", "pow", "neg", "exp", "sqrt", "reciprocal", "sigmoid",
     "relu", "gelu", "where", "_softmax", "sum", "mean", "amax", "_to_copy", "alias", "permute",
     "matmul", "cat", "erf", "tanh"}
)  # fmt: skip


class _RuleEmitter:
    """The ONNX emitter as the shared rules see it: ``view`` is the common view."""

    def __init__(self, em: Emitter, view: OnnxNodeView) -> None:
        self._em, self.view = em, view

    def __getattr__(self, name: str) -> object:
        return getattr(self._em, name)


class OnnxFrontend:
    """The ONNX frontend's side of :class:`~torch2step.frontend.engine.Frontend`."""

    advice = (
        "export MoE experts with HF experts_implementation='batched_mm', or 'grouped_mm' with "
        "torch.onnx.export(..., custom_translation_table="
        "torch2step.frontend.onnx_export.grouped_mm_translation_table()), or as a per-expert "
        "loop; attention as sdpa/eager (opset 20) or the opset-23 Attention op, with a causal or "
        "kv_lengths mask; otherwise add a translator to "
        "torch2step.frontend.onnx_translate.TRANSLATORS or a pattern to "
        "torch2step.frontend.onnx_import.PATTERNS."
    )

    def __init__(self, view: OnnxNodeView) -> None:
        self.view = view

    def outputs(self) -> list[GNode]:
        return [self.view.node(o) for o in self.view.onnx.outputs]

    def reads(self, node: GNode) -> list[GNode]:
        return arg_nodes(node.args)

    def check(self, node: GNode) -> str | None:
        onnx_node = node.meta["onnx"]
        if node.target in SHARED_RULES:
            to = ONNX_DTYPES.get(onnx_node.attr("to")) if node.target == "_to_copy" else "fp32"
            if to in (None, "fp64"):
                return f"Cast to ONNX type {onnx_node.attr('to')} has no layer dtype"
            why = check_node(self.view, node)
            return None if why is None else f"{onnx_node.op_type}: {why}"
        if node.target == "getitem" or (
            onnx_node.domain == "" and onnx_node.op_type in TRANSLATORS
        ):
            return None
        dom = f" (domain {onnx_node.domain!r})" if onnx_node.domain else ""
        hint = _HINTS.get(onnx_node.op_type, "no layer op or raising pattern covers it")
        if onnx_node.op_type == "Shape" and not dom:
            hint = _shape_hint(self.view.onnx, onnx_node) or hint
        return f"no translation for {onnx_node.op_type}{dom}: {hint}"

    def describe(self, node: GNode) -> str:
        return node.meta["onnx"].source

    def translate(self, em: Emitter, node: GNode) -> None:
        if node.target in SHARED_RULES:  # the PyTorch frontend's rule, reading the common view
            em.at(node)
            rule = rule_for(node)
            assert rule is not None
            em.bind(node.name, rule(_RuleEmitter(em, self.view), node))  # type: ignore[arg-type]
        elif node.target != "getitem":  # a multi-output node binds all its values
            TRANSLATORS[node.meta["onnx"].op_type](em, node.meta["onnx"])

    def bind(self, em: Emitter, root: GNode, value: str) -> None:
        em.bind(root.name, value)

    def has(self, em: Emitter, node: GNode) -> bool:
        onnx_node = node.meta.get("onnx")
        if onnx_node is None or node.target == "getitem" or len(onnx_node.outputs) == 1:
            return em.has(node.name)
        return any(em.has(o) for o in onnx_node.outputs if o)


#: Op types whose outputs' sizes depend on the data.
_DATA_DEPENDENT = frozenset({"NonZero", "Unique", "Compress", "Loop", "If", "Scan"})


def _shape_hint(view: OnnxView, node: OnnxNode) -> str | None:
    """Why ``Shape`` of a value that no data-dependent op computes was not folded: its dims
    that are no input's (left unknown by shape inference), or None."""
    shape = view.shape(node.inputs[0])
    if shape is None:
        return (
            f"ONNX shape inference left the shape of {node.inputs[0]!r} unknown; re-export with "
            "torch.onnx.export(..., dynamo=True), which records every shape"
        )
    unknown = [str(d) for d in shape if d is None or not view.is_graph_dim(d)]
    if not unknown or _depends_on_data(view, node.inputs[0]):
        return None
    unknown = ["?" if d == "None" else d for d in unknown]
    return f"the shape of {node.inputs[0]!r} is not known: " + unknown_dims_advice(unknown)


def _depends_on_data(view: OnnxView, value: str) -> bool:
    """Whether a data-dependent op (``NonZero``, ``Loop``, ...) is upstream of ``value``."""
    seen, stack = set(), [value]
    while stack:
        node = view.producer.get(stack.pop())
        if node is None or node.name in seen:
            continue
        if node.op_type in _DATA_DEPENDENT:
            return True
        seen.add(node.name)
        stack.extend(x for x in node.inputs if x)
    return False


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
    fold_constants(view)
    graph = LayerGraph(name=name or model.graph.name or "onnx")
    for inp in view.inputs:
        shape = tuple(d for d in view.shapes[inp] if d is not None)  # all known after build
        graph.add_input(inp, TensorType(shape, view.dtypes.get(inp, "fp32")))
    em = Emitter(view, graph)
    for inp in view.inputs:
        em.bind(inp, inp)
    front = OnnxFrontend(view.node_view())
    raise_graph(front, PATTERNS if patterns is None else patterns, em, f"ONNX model {graph.name!r}")
    graph.outputs = [_output(em, o) for o in view.outputs]
    graph.single_output = len(graph.outputs) == 1
    graph.drop_dead()
    return graph


def _output(em: Emitter, value: str) -> str:
    try:
        return em.get(value)
    except KeyError:
        raise FrontendError(f"graph output {value!r} was not computed") from None
