"""The expert projections of an ONNX MoE region.

Every spelling of routed SwiGLU experts (the MoE workload of STeP §5.1) contains, per expert,
``down(act(gate x) * up x)``; what differs is how the weight operand of each matmul is obtained:

- HF ``batched_mm``: ``MatMul(GatherND(W[E, out, in], ids), Unsqueeze(x, -1))`` (a weight copy per
  (token, expert) pair, ``gate_up`` fused and ``Split``);
- HF ``grouped_mm``: ``MatMul(Unsqueeze(x, 1), Gather(W^T[E, in, out], expert_of_row))`` on rows
  sorted by expert;
- a loop over experts: ``Gemm(x_e, W_e, transB=1)`` with per-expert constants ``W_e``.

:func:`expert_matmuls` finds the matmuls whose weight operand comes from constants and returns
each expert's matrix as ``[out, in]``; :func:`onnx_projections` hands them to the MoE recogniser
of both frontends (:mod:`torch2step.frontend.raise_moe_region`) as its projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.raise_moe_body import Proj, ProjFn

__all__ = ["ExpertMatmul", "expert_matmuls", "onnx_projections"]

_WEIGHT_VIEWS = ("Unsqueeze", "Squeeze", "Identity", "Cast")
_ACT_VIEWS = ("Unsqueeze", "Squeeze", "Identity", "Reshape", "Cast")


@dataclass
class ExpertMatmul:
    """A matmul of activations ``x_in [n, in]`` with expert weights; ``mats`` is ``[E, out, in]``
    (``dynamic``: selected per row at run time) or ``[out, in]`` (one expert's constant)."""

    node: OnnxNode
    x_in: str
    out: str
    mats: np.ndarray
    dynamic: bool


def _trace_weight(view: OnnxView, value: str) -> tuple[np.ndarray, bool, bool] | None:
    """``value`` = views/transposes/expert selections of a constant -> ``(constant, transposed,
    dynamic)``."""
    transposed = dynamic = False
    while True:
        c = view.const(value)
        if c is not None:
            return c, transposed, dynamic
        p = view.producer.get(value)
        if p is None:
            return None
        if p.op_type in _WEIGHT_VIEWS:
            value = p.inputs[0]
        elif p.op_type == "Transpose":
            perm = list(p.attr("perm") or [])
            n = len(perm)
            if n < 2 or perm[: n - 2] != list(range(n - 2)) or perm[n - 2 :] != [n - 1, n - 2]:
                return None
            transposed = not transposed
            value = p.inputs[0]
        elif p.op_type in ("Gather", "GatherND") and view.const(p.inputs[0]) is not None:
            if p.op_type == "Gather" and int(p.attr("axis", 0)) != 0:
                return None
            if p.op_type == "GatherND" and int(p.attr("batch_dims", 0)) != 0:
                return None
            dynamic = True
            value = p.inputs[0]
        else:
            return None


def _strip_act(view: OnnxView, value: str) -> str:
    while True:
        p = view.producer.get(value)
        if p is None or p.op_type not in _ACT_VIEWS:
            return value
        value = p.inputs[0]


def _out(view: OnnxView, value: str) -> str:
    """Follow single-use Squeeze/Reshape after a matmul to the ``[n, out]`` result."""
    while True:
        users = view.users(value)
        if len(users) != 1 or users[0].op_type not in ("Squeeze", "Reshape", "Identity"):
            return value
        value = users[0].outputs[0]


def expert_matmuls(view: OnnxView, region: set[str]) -> list[ExpertMatmul]:
    """The matmuls of ``region`` with a weight operand computed from constants."""
    found: list[ExpertMatmul] = []
    for node in sorted((view.by_name[n] for n in region), key=lambda n: n.index):
        if node.op_type == "Gemm":
            t = _trace_weight(view, node.inputs[1])
            if t is None or node.attr("transA", 0) or len(node.inputs) > 2 and node.inputs[2]:
                continue
            c, tr, dyn = t
            tr ^= not node.attr("transB", 0)  # Gemm computes A @ B^T when transB
            mats = c if not tr else np.swapaxes(c, -1, -2)
            found.append(
                ExpertMatmul(node, _strip_act(view, node.inputs[0]), node.outputs[0], mats, dyn)
            )
        elif node.op_type == "MatMul":
            a, b = node.inputs
            ta, tb = _trace_weight(view, a), _trace_weight(view, b)
            if tb is not None and ta is None:  # x @ W: W is [in, out]
                c, tr, dyn = tb
                mats = np.swapaxes(c, -1, -2) if not tr else c
                x = a
            elif ta is not None and tb is None:  # W @ x (batched_mm): W is [out, in]
                c, tr, dyn = ta
                mats = c if not tr else np.swapaxes(c, -1, -2)
                x = b
            else:
                continue
            if mats.ndim not in (2, 3):
                continue
            found.append(
                ExpertMatmul(node, _strip_act(view, x), _out(view, node.outputs[0]), mats, dyn)
            )
    return found


def onnx_projections(nv: Any, region: set[Any]) -> ProjFn:
    """The expert projections of ``region`` (common-view nodes) as the MoE recogniser of both
    frontends reads them (:mod:`torch2step.frontend.raise_moe_region`)."""
    view = nv.onnx
    ems = expert_matmuls(view, {g.meta["onnx"].name for g in region if "onnx" in g.meta})
    by_out = {em.out: em for em in ems} | {em.node.outputs[0]: em for em in ems}

    def proj(_: Any, node: Any) -> Proj | None:
        em = by_out.get(node.name) or by_out.get(_strip_act(view, node.name))
        if em is None:
            return None
        w = torch.from_numpy(np.array(em.mats, dtype=np.float32))
        return Proj(nv.node(em.x_in), w, em.dynamic, nv.node(em.out))

    return proj
