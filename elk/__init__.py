"""Operator scheduling for kernel-by-kernel execution on inter-core-connected chips (ELK §4).

Per-operator partition plans and their cost model (:mod:`elk.cost`), Pareto plans and
cost-aware on-chip memory allocation (:mod:`elk.allocate`, ELK §4.3), two-level inductive
scheduling over preload numbers (:mod:`elk.schedule`, §4.2), preload order permutation
(:mod:`elk.reorder`, §4.4), the designs of ELK §6.1 (:mod:`elk.designs`) and the printable plan
(:mod:`elk.plan`).  The spatial (SDA) placement used by ``Program.report`` is in
``torch2step.spatial``.
"""

from elk.designs import DESIGNS, plan_design
from elk.errors import ElkError
from elk.ops import DECODERS, Operator, decode_step_ops
from elk.plan import ElkSchedule, format_schedule, plan_model

__all__ = [
    "DESIGNS",
    "DECODERS",
    "ElkError",
    "ElkSchedule",
    "Operator",
    "decode_step_ops",
    "format_schedule",
    "plan_design",
    "plan_model",
]
