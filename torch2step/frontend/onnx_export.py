"""Help for exporting HuggingFace MoE blocks to ONNX so that :func:`import_onnx` can raise them.

HF ``experts_implementation="grouped_mm"`` runs the experts through an opaque grouped matmul:
``transformers::grouped_mm_fallback`` (fp32, and whenever ``torch.export`` traces the block) or
``aten._grouped_mm`` with ``offs`` (bf16).  The dynamo ONNX exporter has no translation for either
("No ONNX function found for transformers.grouped_mm_fallback"), so such a block does not export
as is.  :func:`grouped_mm_translation_table` gives ``torch.onnx.export(...,
custom_translation_table=...)`` a translation into standard ONNX ops: row ``r`` of the
expert-sorted input belongs to expert ``sum_e(offs[e] <= r)``, whose matrix is gathered and
multiplied (``Range``/``LessOrEqual``/``ReduceSum``/``Gather``/``MatMul``).  The result runs in
onnxruntime and is raised by the ``moe_experts`` pattern like the other spellings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["grouped_mm_translation_table"]


def _grouped_rows_matmul(op: Any, x: Any, weight: Any, offs: Any) -> Any:
    """``out[r] = x[r] @ weight[expert(r)]`` with ``expert(r) = #{e : offs[e] <= r}``."""
    n = op.Squeeze(op.Shape(x, start=0, end=1))
    rows = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    ends = op.Unsqueeze(op.Cast(offs, to=7), op.Constant(value_ints=[0]))
    before = op.LessOrEqual(ends, op.Unsqueeze(rows, op.Constant(value_ints=[1])))
    expert = op.ReduceSum(op.Cast(before, to=7), op.Constant(value_ints=[1]), keepdims=0)
    last = op.Sub(op.Shape(weight, start=0, end=1), op.Constant(value_ints=[1]))
    expert = op.Min(expert, op.Squeeze(last))  # rows past the last offset (none without EP)
    selected = op.Gather(weight, expert, axis=0)
    prod = op.MatMul(op.Unsqueeze(x, op.Constant(value_ints=[1])), selected)
    return op.Squeeze(prod, op.Constant(value_ints=[1]))


def grouped_mm_translation_table() -> dict[Any, Callable[..., Any]]:
    """``{op overload: onnxscript translation}`` for HF's grouped matmuls (needs ``onnxscript``;
    import ``transformers`` first so that its ``grouped_mm_fallback`` op is registered)."""
    import torch
    from onnxscript import opset20 as op

    def fallback(input: Any, weight: Any, offs: Any) -> Any:
        return _grouped_rows_matmul(op, input, weight, offs)

    def aten_grouped_mm(
        self: Any, mat2: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None
    ) -> Any:
        if offs is None or bias is not None:
            raise NotImplementedError(
                "grouped_mm translation: only the grouped form with offsets and no bias is "
                "translated; export experts without biases, or use experts_implementation="
                "'batched_mm'"
            )
        return _grouped_rows_matmul(op, self, mat2, offs)

    table: dict[Any, Callable[..., Any]] = {torch.ops.aten._grouped_mm.default: aten_grouped_mm}
    transformers_ops = getattr(torch.ops, "transformers", None)
    if transformers_ops is not None and hasattr(transformers_ops, "grouped_mm_fallback"):
        table[transformers_ops.grouped_mm_fallback.default] = fallback
    return table
