"""Kernel-by-kernel execution on inter-core-connected chips: a layer (or a shapes-only decode
step) becomes ELK operators (:mod:`elk`), an ELK schedule, per-core programs
(:mod:`lowering.elk_programs`) and a simulation on :mod:`runtime`, reported in ELK's terms."""

from torch2step.kernel.build import bind_timing, build_programs
from torch2step.kernel.report import KernelReport, simulate_schedule

__all__ = ["bind_timing", "build_programs", "KernelReport", "simulate_schedule"]
