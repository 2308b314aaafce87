"""Running a piece of an ONNX graph on sample inputs (``onnx.reference``), to decide what it
means: raising patterns check a recognised meaning against the exporter's own computation
(an MoE region against :class:`~torch2step.layers.ops.MoEExperts`, a mask subgraph against the
causal / KV-length masks of :class:`~torch2step.layers.ops.Attention`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import sympy
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from torch2step.frontend.onnx_emit import Unsupported
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView

__all__ = ["run_subgraph", "upstream", "concrete_value"]

_ELEM = {
    "fp32": onnx.TensorProto.FLOAT,
    "int64": onnx.TensorProto.INT64,
    "bool": onnx.TensorProto.BOOL,
}


def upstream(view: OnnxView, values: Iterable[str], stop: set[str]) -> list[OnnxNode]:
    """The run-time nodes computing ``values`` from ``stop`` values, graph inputs and known
    values, in topological order."""
    found: dict[str, OnnxNode] = {}
    stack = list(values)
    while stack:
        v = stack.pop()
        if v in stop or v in view.known:
            continue
        p = view.producer.get(v)
        if p is None or p.name in found:
            continue
        found[p.name] = p
        stack.extend(x for x in p.inputs if x)
    return sorted(found.values(), key=lambda n: n.index)


def concrete_value(value: np.ndarray, sample: Mapping[sympy.Symbol, int]) -> np.ndarray:
    if value.dtype != object:
        return value
    flat = [int(sympy.sympify(x).subs(sample)) for x in value.reshape(-1).tolist()]
    return np.array(flat, dtype=np.int64).reshape(value.shape)


def run_subgraph(
    view: OnnxView,
    nodes: list[OnnxNode],
    feeds: Mapping[str, np.ndarray],
    outputs: list[str],
    sample: Mapping[sympy.Symbol, int],
) -> list[np.ndarray]:
    """Evaluate ``nodes`` (topological order) on ``feeds``; every other value they read must be
    known before run time (symbolic ones are taken at the ``sample`` dims)."""
    produced = {o for n in nodes for o in n.outputs}
    inits: dict[str, onnx.TensorProto] = {}
    for n in nodes:
        for i in n.inputs:
            if not i or i in produced or i in feeds or i in inits:
                continue
            known = view.known.get(i)
            if known is None:
                raise Unsupported(f"the probed subgraph reads the run-time value {i!r}")
            inits[i] = numpy_helper.from_array(concrete_value(known, sample), i)
    graph = helper.make_graph(
        [n.proto for n in nodes if n.proto is not None],
        "probe",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in feeds.items()
        ],
        [
            helper.make_tensor_value_info(o, _ELEM.get(view.dtypes.get(o, ""), 0), None)
            for o in outputs
        ],
        list(inits.values()),
    )
    model = helper.make_model(graph, opset_imports=list(view.model.opset_import))
    model.ir_version = view.model.ir_version
    try:
        return list(ReferenceEvaluator(model).run(outputs, dict(feeds)))
    except Exception as exc:  # noqa: BLE001 - any failure means the probe is inconclusive
        raise Unsupported(f"probing the subgraph failed ({type(exc).__name__}: {exc})") from exc
