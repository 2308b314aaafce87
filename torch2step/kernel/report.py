"""Simulating an ELK schedule and reporting it in ELK's terms (ELK §6.2-§6.3)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elk.plan import ElkSchedule
from hwmodel.chip import Chip
from runtime import SimResult, gc_paused, simulate
from torch2step.kernel.build import build_programs

__all__ = ["KernelReport", "noc_busy", "noc_mean", "per_token", "simulate_schedule"]


@dataclass(frozen=True)
class KernelReport:
    """A simulated ELK schedule: predicted and simulated cycles, breakdown, utilisations."""

    schedule: ElkSchedule
    cycles: int
    sim_seconds: float
    hbm_util: float
    noc_util: float
    tokens: int = 1
    noc_mean: float = 0.0
    result: SimResult | None = field(default=None, compare=False, repr=False)
    notes: tuple[str, ...] = ()  # what the operators assume (e.g. a MoE's active experts)

    @property
    def predicted(self) -> float:
        return self.schedule.cycles

    @property
    def error(self) -> float:
        """Relative difference of the plan's prediction from the simulation."""
        return self.predicted / self.cycles - 1.0 if self.cycles else 0.0

    @property
    def ideal_cycles(self) -> float:
        """Predicted cycles of the Ideal design (ELK §6.1) for the same operators."""
        return self.schedule.ideal().cycles

    @property
    def flop_util(self) -> float:
        """FLOP utilisation of the simulated run (ELK §6.3)."""
        return self.schedule.flop_utilisation(self.cycles)

    def to_dict(self) -> dict[str, Any]:
        s = self.schedule
        return {
            "execution": "kernel",
            "design": s.design,
            "chip": s.costs.name,
            "operators": len(s.ops),
            "cycles": self.cycles,
            # the spatial report's names for the same figures (torch2step.report.Report)
            "latency_cycles": self.cycles,
            "latency_s": self.cycles / (s.costs.clock_ghz * 1e9),
            "predicted_cycles": round(self.predicted),
            "latency_us": self.cycles / (s.costs.clock_ghz * 1e3),
            "hbm_util": round(self.hbm_util, 4),
            "noc_util": round(self.noc_util, 4),
            "noc_mean_resource_util": round(self.noc_mean, 4),
            "flop_util": round(self.flop_util, 5),
            "ideal_cycles": round(self.ideal_cycles),
            "of_ideal": round(self.ideal_cycles / self.cycles, 4) if self.cycles else None,
            "plan_s": round(s.plan_seconds, 3),
            # the plan's search budget where it is not plan_model's default (elk.plan)
            **({"plan_search": dict(s.search)} if s.search else {}),
            "sim_s": round(self.sim_seconds, 3),
            "breakdown": {k: round(v / max(s.cycles, 1e-9), 4) for k, v in s.breakdown().items()},
            **({"notes": list(self.notes)} if self.notes else {}),
        }

    def __str__(self) -> str:
        s = self.schedule
        us = self.cycles / (s.costs.clock_ghz * 1e3)
        b = s.breakdown()
        tot = max(s.cycles, 1e-9)
        ideal = self.ideal_cycles
        return "\n".join(
            [
                f"kernel-by-kernel ({s.design}) on {s.costs.name}: {self.cycles} cycles simulated "
                f"= {us:.1f} us{per_token(us, self.tokens)}, "
                f"plan predicted {self.predicted:.0f} ({self.error:+.1%})",
                "ELK breakdown (plan): " + ", ".join(f"{k} {v / tot:.1%}" for k, v in b.items()),
                f"HBM utilisation {self.hbm_util:.1%} (bytes moved over peak bandwidth, ELK "
                f"Fig. 18 (b))  interconnect utilisation "
                f"{self.noc_util:.1%} (busy time, as the plan and ELK Fig. 18 (c) count it; "
                f"plan {s.noc_utilisation():.1%})  mean {_MEAN_OF[s.costs.mesh is None]} "
                f"utilisation {self.noc_mean:.1%}  FLOP utilisation {self.flop_util:.2%}",
                f"Ideal (ELK §6.1) predicts {ideal:.0f} cycles: simulated run at "
                f"{ideal / max(1, self.cycles):.1%} of Ideal (plan {ideal / tot:.1%})"
                + (
                    " — faster than Ideal's prediction: the cost model's own error, "
                    f"{self.error:+.1%} on this plan"
                    if ideal > self.cycles
                    else ""
                ),
                f"plan {s.plan_seconds:.2f} s  simulation {self.sim_seconds:.2f} s",
                *(f"note: {n}" for n in self.notes),
            ]
        )


#: what :attr:`KernelReport.noc_mean` averages, by whether the chip is all-to-all
_MEAN_OF = {True: "port", False: "link"}


def hbm_bandwidth(res: SimResult, chip: Chip) -> float:
    """HBM bandwidth utilisation of a simulated run (ELK §6.3 Fig. 18 (b)): the bytes its
    channels moved over what their peak bandwidth could move in the run's cycles.  Not the
    channels' busy cycles (:meth:`runtime.stats.SimStats.hbm_utilisation`): a channel is
    also held while a request's tail drains into a slower port, and the background preloads
    share the channels' summed bandwidth (:mod:`runtime.network`), so busy cycles can add
    up to more than the run (e.g. 103% for a MoE layer whose preloads overlap its loads)."""
    st = res.stats
    peak = chip.hbm.bytes_per_cycle * st.cycles
    return sum(r.bytes for r in st.hbm_channels) / peak if peak else 0.0


def noc_busy(res: SimResult) -> float:
    """Interconnect utilisation of a simulated run counted as
    :meth:`elk.plan.ElkSchedule.noc_utilisation` counts the plan's (ELK §6.3 Fig. 18 (c),
    §6.4 Fig. 21): the cycles the interconnect is busy over the run's cycles.  On an
    all-to-all chip every byte delivered to a core (a peer's message, an HBM read) occupies
    that core's ejection port (:mod:`runtime.network`), so the busy time is the ejection
    ports' busy cycles over all of them (the plan: the bytes crossing the worker cores' ports
    over their aggregate bandwidth).  On a mesh a delivery
    keeps the interconnect busy while its busiest link carries it; the simulator records busy
    cycles per link, not per delivery, so the run's busiest link stands for it (the links at
    the edge controllers carry every preload, ELK §5)."""
    st = res.stats
    if not st.cycles:
        return 0.0
    if st.links:
        return max(r.busy for r in st.links) / st.cycles
    ej = [r.busy for r in st.ports if r.kind == "eject"]
    return sum(ej) / (len(ej) * st.cycles) if ej else 0.0


def noc_mean(res: SimResult) -> float:
    """The mean utilisation of the interconnect's resources (a mesh's links, an all-to-all
    chip's injection and ejection ports), unused ones included: idle links and each
    message's two ports make it lower than :func:`noc_busy`'s busy time."""
    st = res.stats
    group = st.links if st.links else st.ports
    used = [r.utilisation for r in group]
    return sum(used) / len(used) if used else 0.0


def simulate_schedule(
    sched: ElkSchedule,
    chip: Chip,
    *,
    mode: str = "timing",
    programs: Any = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    tokens: int = 1,
    copy_starts: bool = False,
) -> KernelReport:
    """Simulate ``sched`` on ``chip`` (its programs built for timing unless given;
    ``copy_starts``: see :meth:`runtime.Simulator.run`)."""
    with gc_paused():  # one pause across building, compiling and running (runtime.gc_paused)
        ps = programs if programs is not None else build_programs(sched, chip)
        t0 = time.perf_counter()
        res = simulate(ps, chip, mode=mode, inputs=dict(inputs or {}), copy_starts=copy_starts)
        wall = time.perf_counter() - t0
    return KernelReport(
        sched,
        res.cycles,
        wall,
        hbm_bandwidth(res, chip),
        noc_busy(res),
        tokens,
        noc_mean(res),
        res,
    )


def per_token(us: float, tokens: int) -> str:
    """`` (X us per token of the batch)`` for a batch of ``tokens`` tokens above one (a batch
    of one, or an unknown one, shows the latency alone)."""
    return f" ({us / tokens:.2f} us per token of the batch)" if tokens > 1 else ""
