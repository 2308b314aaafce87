"""``strategy="auto"``: search the §5 strategies of STeP (arXiv 2511.07776) for a layer.

The space: for a Mixture-of-Experts layer, the tiling of each expert's tokens (dynamic, §5.2,
or static tiles of 16 / 32 / 64 rows) times the expert regions (one per expert, or ``E/2,
E/4, ...`` regions time-multiplexed by ``E/R`` consecutive experts each, §5.3); for decode
attention, the parallel regions (1, 2, 4) times the request assignment (interleaved or
dynamic, §5.4).  Every candidate is compiled and run once by the timing-only interpreter
(the run gives the dynamic sizes: tokens per expert, KV lengths), then

1. **pruned by the §4.1 formulas**: its on-chip memory requirement (STeP §4.1) at this input
   must fit ``onchip_budget`` bytes and its allocated compute (units applying a tile
   function with FLOPs, each at the core's rate) ``compute_budget`` FLOPs/cycle;
2. **decided by the simulator**: the survivors are simulated on the chip; the fastest wins
   (ties: less on-chip memory).  A candidate whose units do not fit the chip is recorded as
   such.

The table of candidates tried (cycles, off-chip bytes, on-chip bytes, allocated FLOPs/cycle,
compute utilisation, what pruned it) is logged (the ``torch2step`` logger, at INFO) and kept
as ``Program.strategy_table``; the chosen program's report carries it as a note.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hwmodel.chip import Chip
from torch2step.errors import LoweringError, ScheduleError, Torch2StepError
from torch2step.layers import ops as L
from torch2step.layers.graph import LayerGraph

__all__ = ["Candidate", "candidates", "search", "format_table"]

STATIC_TILES = (16, 32, 64)
ATTN_REGIONS = (None, 2, 4)


@dataclass
class Candidate:
    """One strategy tried: its compile options and what the search measured."""

    options: dict[str, Any]
    onchip_bytes: int = 0
    alloc_flops_per_cycle: int = 0
    cycles: int | None = None
    offchip_bytes: int | None = None
    sim_onchip_bytes: int | None = None
    compute_util: float | None = None
    status: str = ""

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.options.items()) or "default"


def candidates(layer: LayerGraph) -> list[dict[str, Any]]:
    """The option sets the search tries for ``layer`` (module docstring)."""
    moe: list[dict[str, Any]] = [{}]
    experts = [n.op.num_experts for n in layer.ops(L.MoEExperts)]
    if experts:
        E = experts[0]
        lanes = [0] + [E // d for d in (2, 4, 8, 16) if E % d == 0 and E // d >= 2]
        moe = [
            {"moe_lanes": r, **({} if t is None else {"moe_static_tile": t})}
            for r, t in itertools.product(lanes, (None, *STATIC_TILES))
        ]
    attn: list[dict[str, Any]] = [{}]
    if any(True for _ in layer.ops(L.Attention)):
        attn = [{}] + [
            {"attn_regions": r, "attn_assign": a}
            for r in ATTN_REGIONS
            if r is not None
            for a in ("interleave", "dynamic")
        ]
    return [{**m, **a} for m in moe for a in attn]


def _alloc(program: Any, chip: Chip) -> int:
    from torch2step.step.ops_compute import Accum, FlatMap, Map, Scan

    units = sum(
        1
        for op in program.step.nodes
        if isinstance(op, (Map, Accum, Scan, FlatMap)) and op.fn.spec.flops is not None
    )
    from torch2step.spatial.timing import TimingModel

    return units * TimingModel(chip).default_rate


def search(
    layer: LayerGraph,
    chip: Chip,
    example_inputs: Sequence[Any],
    options: dict[str, Any],
    *,
    onchip_budget: int | None = None,
    compute_budget: int | None = None,
    inputs: Sequence[Any] = (),
    routing: Any = None,
    echo: bool = True,
) -> Any:
    """Compile ``layer`` under every candidate strategy, prune, simulate, return the best
    :class:`~torch2step.program.Program` (module docstring).  ``options``: the user's other
    compile options (kept in every candidate); ``inputs`` / ``routing``: the input the search
    is decided on (default: the example inputs)."""
    from torch2step.lower import LowerOptions, lower
    from torch2step.program import Program

    tried: list[Candidate] = []
    best: tuple[tuple[int, int], Program, Candidate] | None = None
    for extra in candidates(layer):
        opts = {**options, **extra}
        c = Candidate(extra)
        tried.append(c)
        try:
            prog = Program(layer, lower(layer, LowerOptions(**opts)), chip, tuple(example_inputs))
        except Torch2StepError as e:
            c.status = f"no lowering: {str(e)[:60]}"
            continue
        _, res, _, _ = prog._execute(inputs, routing, timing_only=True, standins=True)
        c.onchip_bytes = int(prog.metrics.evaluate(res.bindings)["onchip_bytes"])
        c.alloc_flops_per_cycle = _alloc(prog, chip)
        if onchip_budget is not None and c.onchip_bytes > onchip_budget:
            c.status = "pruned: §4.1 on-chip > budget"
            continue
        if compute_budget is not None and c.alloc_flops_per_cycle > compute_budget:
            c.status = "pruned: allocated compute > budget"
            continue
        try:
            rep = prog.report(*inputs, routing=routing)
        except (ScheduleError, LoweringError) as e:
            c.status = f"does not fit: {str(e)[:60]}"
            continue
        c.cycles, c.offchip_bytes = rep.latency_cycles, rep.hbm_bytes
        c.sim_onchip_bytes = rep.simulated_onchip_bytes
        c.compute_util = rep.flops / (rep.latency_cycles * c.alloc_flops_per_cycle or 1)
        c.status = "simulated"
        key = (c.cycles, c.onchip_bytes)
        if best is None or key < best[0]:
            best = (key, prog, c)
    if best is None:
        raise ScheduleError(
            f"strategy=auto: none of the {len(tried)} candidate strategies for "
            f"{layer.name} fits (on-chip budget {onchip_budget}, compute budget "
            f"{compute_budget}, chip {chip.name!r}); raise the budgets or use a bigger chip\n"
            + format_table(tried, None)
        )
    _, prog, chosen = best
    chosen.status = "chosen"
    prog.strategy_table = format_table(tried, chosen)
    prog.strategy_options = {**options, **chosen.options}
    if echo:  # on stderr through the package's logger: a report keeps it as a note
        logging.getLogger("torch2step").info("%s", prog.strategy_table)
    return prog


def format_table(tried: Sequence[Candidate], chosen: Candidate | None) -> str:
    """The candidates as a printable table."""
    head = (
        f"strategy=auto: {len(tried)} candidates"
        + (f", chosen {chosen.label}" if chosen is not None else "")
        + "\n"
        + f"  {'options':<44} {'cycles':>11} {'offchip B':>13} {'onchip B':>12} "
        f"{'sim onchip B':>13} {'FLOPs/cyc':>10} {'util':>6}  status"
    )
    lines = [head]
    for c in tried:
        def num(v: int | None) -> str:
            return f"{v:,}" if v is not None else "-"

        util = f"{100 * c.compute_util:5.1f}%" if c.compute_util is not None else "-"
        lines.append(
            f"  {c.label:<44} {num(c.cycles):>11} {num(c.offchip_bytes):>13} "
            f"{num(c.onchip_bytes):>12} {num(c.sim_onchip_bytes):>13} "
            f"{num(c.alloc_flops_per_cycle):>10} {util:>6}  {c.status}"
        )
    return "\n".join(lines)
