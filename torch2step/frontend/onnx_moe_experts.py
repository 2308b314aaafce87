"""Reading the expert MLPs of an MoE region, and checking the recognised meaning.

Every spelling of routed SwiGLU experts (the MoE workload of STeP §5.1) contains, per expert,
``down(act(gate x) * up x)``; what differs is how the weight operand of each matmul is obtained:

- HF ``batched_mm``: ``MatMul(GatherND(W[E, out, in], ids), Unsqueeze(x, -1))`` (a weight copy per
  (token, expert) pair, ``gate_up`` fused and ``Split``);
- HF ``grouped_mm``: ``MatMul(Unsqueeze(x, 1), Gather(W^T[E, in, out], expert_of_row))`` on rows
  sorted by expert;
- a loop over experts: ``Gemm(x_e, W_e, transB=1)`` with per-expert constants ``W_e``.

:func:`expert_matmuls` finds the matmuls whose weight operand comes from constants and returns
each expert's matrix as ``[out, in]``; :func:`read_mlps` walks from each second-layer matmul back
through the activation to the gate and up projections.  :func:`verify_moe` runs the ONNX region
on sample routings (one leaving experts without tokens) and compares it with
:class:`~torch2step.layers.ops.MoEExperts` on the extracted weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torch2step.frontend.onnx_emit import Unsupported
from torch2step.frontend.onnx_graph import OnnxNode, OnnxView
from torch2step.frontend.onnx_probe import run_subgraph
from torch2step.layers import ops as L
from torch2step.layers.evaluate import EVALUATORS

__all__ = ["ExpertMatmul", "MLP", "expert_matmuls", "read_mlps", "verify_moe", "VERIFY_LIMIT"]

#: Verification is skipped when one probe would multiply more weight elements than this.
VERIFY_LIMIT = 1 << 26

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


@dataclass
class MLP:
    """One gated MLP: ``down(act(gate x) * up x)``; matrices ``[.., I, H]``/``[.., H, I]``."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    activation: str
    x_in: str
    dynamic: bool
    nodes: set[str]


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


def _activation(view: OnnxView, value: str) -> tuple[str, str, set[str]] | None:
    """``value = act(g)`` -> ``(act name, g, nodes)``."""
    p = view.producer.get(value)
    if p is None:
        return None
    if p.op_type == "Mul":
        for i in (0, 1):
            s = view.producer_of(p.inputs[1 - i], "Sigmoid")
            if s is not None and s.inputs[0] == p.inputs[i]:
                return "silu", p.inputs[i], {p.name, s.name}
    if p.op_type in ("Relu", "Gelu") and p.attr("approximate", "none") == "none":
        return p.op_type.lower(), p.inputs[0], {p.name}
    return None


def _lookup(view: OnnxView, value: str, by_out: dict[str, ExpertMatmul]) -> ExpertMatmul | None:
    return by_out.get(value) or by_out.get(_strip_act(view, value))


def _halves(
    view: OnnxView, g: str, u: str, by_out: dict[str, ExpertMatmul]
) -> tuple[ExpertMatmul, bool] | None:
    """``g``/``u`` are the two halves (Split or Slice on the last axis) of one fused matmul:
    ``(matmul, gate_first)``."""
    pg, pu = view.producer.get(g), view.producer.get(u)
    if pg is None or pu is None:
        return None
    if pg is pu and pg.op_type == "Split" and len(pg.outputs) == 2:
        em = _lookup(view, pg.inputs[0], by_out)
        rank = view.rank(pg.inputs[0]) or 0
        if em is None or int(pg.attr("axis", 0)) % max(rank, 1) != rank - 1:
            return None
        return em, pg.outputs[0] == g
    if pg.op_type == "Slice" and pu.op_type == "Slice" and pg.inputs[0] == pu.inputs[0]:
        em = _lookup(view, pg.inputs[0], by_out)
        sg, su = view.ints(pg.inputs[1]), view.ints(pu.inputs[1])
        if em is None or sg is None or su is None:
            return None
        return em, int(sg[0]) == 0
    return None


def read_mlps(view: OnnxView, ems: list[ExpertMatmul]) -> list[MLP]:
    """Gated MLPs from the expert matmuls: each second-layer matmul's input is
    ``act(gate x) * (up x)`` of first-layer matmuls (fused or separate)."""
    by_out = {em.out: em for em in ems} | {em.node.outputs[0]: em for em in ems}
    mlps: list[MLP] = []
    for down in ems:
        h = view.producer_of(down.x_in, "Mul")
        if h is None:
            continue
        for i in (0, 1):
            act = _activation(view, _strip_act(view, h.inputs[i]))
            if act is None:
                continue
            name, g, nodes = act
            g, u = _strip_act(view, g), _strip_act(view, h.inputs[1 - i])
            fused = _halves(view, g, u, by_out)
            if fused is not None:
                em, gate_first = fused
                inter = em.mats.shape[-2] // 2
                first, second = em.mats[..., :inter, :], em.mats[..., inter:, :]
                gate, up = (first, second) if gate_first else (second, first)
                x_in, dyn = em.x_in, em.dynamic
            elif (
                (eg := _lookup(view, g, by_out))
                and (eu := _lookup(view, u, by_out))
                and eg.x_in == eu.x_in
            ):
                gate, up = eg.mats, eu.mats
                x_in, dyn = eg.x_in, eg.dynamic
            else:
                continue
            if gate.shape != up.shape or down.mats.shape[-1] != gate.shape[-2]:
                raise Unsupported(
                    f"expert matrices do not chain: gate {gate.shape}, up {up.shape}, "
                    f"down {down.mats.shape}"
                )
            mlps.append(
                MLP(gate, up, down.mats, name, x_in, dyn and down.dynamic, nodes | {h.name})
            )
            break
    return mlps


def verify_moe(
    view: OnnxView,
    nodes: list[OnnxNode],
    x: str,
    w: str,
    e: str,
    y: str,
    op: L.MoEExperts,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tokens: int,
) -> bool:
    """Run the region on sample routings and compare with ``op``; ``False`` when skipped
    (too large to probe), raises Unsupported on a mismatch."""
    gate, up, down = weights
    hidden = int(gate.shape[2])
    k, n_exp = op.top_k, op.num_experts
    if tokens * k * 3 * gate[0].numel() > VERIFY_LIMIT:
        return False
    rng = np.random.default_rng(1)
    sample = view.sample_dims()
    for only_two in (False, True):
        experts = 2 if only_two else n_exp
        ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int64)
        wts = rng.random((tokens, k)).astype(np.float32) + 0.1
        wts /= wts.sum(-1, keepdims=True)
        xs = rng.standard_normal((tokens, hidden)).astype(np.float32)
        (got,) = run_subgraph(view, nodes, {x: xs, w: wts, e: ids}, [y], sample)
        args = [torch.from_numpy(a) for a in (xs, wts, ids)] + list(weights)
        (want,) = EVALUATORS[L.MoEExperts](op, args)
        if got.shape != tuple(want.shape) or not np.allclose(
            got, want.numpy(), atol=1e-4, rtol=1e-4
        ):
            diff = (
                float(np.abs(got - want.numpy()).max()) if got.shape == tuple(want.shape) else None
            )
            raise Unsupported(
                f"the recognised experts do not reproduce the ONNX computation (max diff {diff}, "
                f"shape {got.shape}); the routing or combination is not top-k weighted sum"
            )
    return True
