"""Does every unit's simulated on-chip memory fit the SRAM of the cores it occupies?

A unit holds its buffers (``sram_bytes``: its core's simulated peak; a buffer allocated at its
largest size in the run, or at a bound counting what it held, ``Alloc.held``) and what
its deepened input FIFOs may hold (``fifo_bytes``, :mod:`.fifos`).  Placement gives a unit
whose buffers exceed one core's SRAM ``ceil(bytes / sram)`` cores (:mod:`.placement`);
FIFOs deepened during the simulation are known only afterwards.  :func:`check_sram` compares
the two after the run: a unit that needs more cores than it was placed on *spans* more cores
(the extra cores serve as its memory, like the placement's extra memory units) as long as the
chip has that many cores in total, and the report says so (:attr:`SpatialResult.memory_notes`);
when the chip has not, it raises :class:`~torch2step.errors.ScheduleError` naming the unit,
its bytes and the core capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hwmodel.chip import Chip
from torch2step.errors import ScheduleError

from .result import UnitRecord

__all__ = ["Span", "check_sram", "sram_spans"]


@dataclass(frozen=True, slots=True)
class Span:
    """A unit whose simulated bytes need ``need`` cores of ``sram`` bytes; it was placed on
    ``placed`` cores."""

    unit: str
    kind: str
    sram_bytes: int
    fifo_bytes: int
    sram: int
    placed: int
    need: int

    @property
    def nbytes(self) -> int:
        return self.sram_bytes + self.fifo_bytes

    def note(self) -> str:
        return (
            f"unit %{self.unit} ({self.kind}) holds {self.nbytes:,} bytes on chip (buffers "
            f"{self.sram_bytes:,}, FIFOs {self.fifo_bytes:,}) > one core's {self.sram:,} bytes "
            f"of SRAM: it spans {self.need} cores"
            + (
                f" (placed on {self.placed}, {self.need - self.placed} more for its FIFOs)"
                if self.need > self.placed
                else ""
            )
        )


def sram_spans(units: tuple[UnitRecord, ...], chip: Chip) -> list[Span]:
    """The units whose simulated bytes exceed one core's SRAM, largest first."""
    sram = chip.core.sram_bytes
    out = []
    for u in units:
        total = u.sram_bytes + u.fifo_bytes
        if total > sram:
            need = math.ceil(total / sram)
            out.append(Span(u.name, u.kind, u.sram_bytes, u.fifo_bytes, sram, len(u.cores), need))
    return sorted(out, key=lambda s: (-s.nbytes, s.unit))


def check_sram(units: tuple[UnitRecord, ...], chip: Chip) -> tuple[str, ...]:
    """Notes for the units that span several cores; raises ``ScheduleError`` when the chip
    has too few cores to give every unit the cores its simulated bytes need."""
    spans = sram_spans(units, chip)
    extra = sum(max(0, s.need - s.placed) for s in spans)
    used = sum(len(u.cores) for u in units)
    if used + extra > chip.num_cores:
        worst = spans[0]
        raise ScheduleError(
            f"unit %{worst.unit} ({worst.kind}) needs {worst.nbytes:,} bytes of on-chip memory "
            f"(buffers {worst.sram_bytes:,}, FIFOs {worst.fifo_bytes:,}) but a core of chip "
            f"{chip.name!r} has {worst.sram:,} bytes of SRAM, and the chip's {chip.num_cores} "
            f"cores cannot give every such unit the cores it needs ({used} placed + {extra} "
            "more); use smaller tiles, shallower streams (fewer tokens in flight) or a chip "
            "with more SRAM per core"
        )
    return tuple(s.note() for s in spans)
