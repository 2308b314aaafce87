"""Operator scheduling for kernel-by-kernel execution on inter-core-connected chips (seed 002 §4).

Per-operator partition plans, the cost model, inductive preload scheduling, cost-aware memory
allocation and preload reordering live here.  Not populated yet: the spatial (SDA) placement used
by ``Program.report`` is in ``torch2step.placement``.
"""
