"""What a unit's program leaves to the run: its bookkeeping as functions of row counts.

A unit that reads the rows of its run-sized tiles at run time (row rules, :mod:`.rows`; buffers
allocated at the count's bound, ``lowering.isa.Alloc.held``) is one program for every row
count (an expert's tokens, STeP arXiv 2511.07776 §5.2 dynamic tiling).  Its FLOPs, step
cycles and the bytes its buffers hold in a run are then not the program's but the run's:
:class:`Sizing` gives them from the run's row counts, for a program kept from another run
(:mod:`.unit_reuse`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .timing import RowRule

__all__ = ["Sizing"]


@dataclass(frozen=True)
class Sizing:
    """What a unit's program leaves to the run, as functions of the row counts of its tiles
    (size expressions such as an expert's token count): its buffers' bytes per pool
    ``(bytes per element x buffers, static elements, ((rows, a, c), ...))`` and its unit
    steps' cycles (``fixed`` plus a :class:`RowRule` per step on a tile of ``rows`` rows).
    A unit whose program reads every such count from the tiles it receives is the same
    program for every run; its bookkeeping in a run is this, evaluated
    (:mod:`.unit_reuse`)."""

    pools: tuple[tuple[int, int, tuple[tuple[object, int, int], ...]], ...]
    fixed: int
    steps: tuple[tuple[RowRule, object, bool], ...]
    fixed_flops: int = 0

    def flops(self, rows: Callable[[object], int]) -> int:
        """FLOPs of the unit's steps with the row counts ``rows`` gives (a step whose rule
        counts FLOPs has them as its first term, :func:`~.rows.row_rule`)."""
        total = self.fixed_flops
        for rule, r, counted in self.steps:
            if counted:
                a, c, _ = rule.terms[0]
                total += a * rows(r) + c
        return total

    def sram_bytes(self, rows: Callable[[object], int]) -> int:
        """Bytes of the unit's buffers with the row counts ``rows`` gives."""
        return sum(
            nb * max([fixed] + [a * rows(r) + c for r, a, c in uses])
            for nb, fixed, uses in self.pools
        )

    def cycles(self, rows: Callable[[object], int]) -> int:
        """Cycles of the unit's steps with the row counts ``rows`` gives."""
        return self.fixed + sum(rule.cycles(rows(r)) for rule, r, _ in self.steps)
