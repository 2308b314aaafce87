"""Frozen chip descriptions: cores, HBM, network-on-chip (mesh or all-to-all), the chip.

Units are in the field names (bytes, cycles, GHz).  Cores are numbered ``0 .. num_cores-1``; on a
mesh, core ``i`` sits at ``(row, col) = divmod(i, cols)``.  This module imports nothing outside
``hwmodel`` (STYLE.md: ``hwmodel`` is the bottom of the import graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hwmodel.errors import ChipConfigError

__all__ = ["CoreSpec", "HbmSpec", "MeshNoC", "AllToAllNoC", "NoC", "Chip"]


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """One compute core (an ICCA core, or an SDA compute+memory unit pair).

    ``flops_per_cycle`` maps a dtype name (``"bf16"``, ``"fp32"``, ...) to the peak FLOPs the core
    retires per cycle in that dtype (a multiply-add counts 2).  ``sram_bytes`` is the local
    scratchpad; ``fifo_depth`` the default number of entries of a stream FIFO between cores;
    ``sram_bytes_per_cycle`` the local memory bandwidth (bounds elementwise kernels).
    """

    flops_per_cycle: tuple[tuple[str, int], ...]
    sram_bytes: int
    sram_bytes_per_cycle: int
    fifo_depth: int = 2
    kernel_launch_cycles: int = 0

    def flops(self, dtype: str) -> int:
        """Peak FLOPs per cycle for ``dtype``."""
        for name, value in self.flops_per_cycle:
            if name == dtype:
                return value
        have = ", ".join(name for name, _ in self.flops_per_cycle)
        raise ChipConfigError(
            f"the core has no {dtype} compute rate (flops_per_cycle gives {have}); add one, "
            f"e.g. --set core.flops_per_cycle.{dtype}=N (compare: --kernel-set or --spatial-set)"
        )


@dataclass(frozen=True, slots=True)
class HbmSpec:
    """Off-chip memory: ``channels`` independent channels, each ``bytes_per_cycle_per_channel``
    wide, each access paying ``latency_cycles``.  ``attach_cores`` lists, per channel, the core
    whose router the channel's port sits next to (mesh); empty means uniform access (all-to-all or
    an SDA whose memory interface is not on the mesh).  Addresses interleave across channels in
    ``interleave_bytes`` granules."""

    channels: int
    bytes_per_cycle_per_channel: float
    latency_cycles: int
    capacity_bytes: int
    interleave_bytes: int = 256
    attach_cores: tuple[int, ...] = ()

    @property
    def bytes_per_cycle(self) -> float:
        """Aggregate peak bandwidth."""
        return self.channels * self.bytes_per_cycle_per_channel


@dataclass(frozen=True, slots=True)
class MeshNoC:
    """A ``rows`` x ``cols`` 2-D mesh with dimension-order (``"xy"``: column first) routing.
    Every directed link carries ``link_bytes_per_cycle``; each hop adds ``hop_latency_cycles``."""

    rows: int
    cols: int
    link_bytes_per_cycle: float
    hop_latency_cycles: int
    routing: Literal["xy", "yx"] = "xy"
    kind: Literal["mesh"] = "mesh"


@dataclass(frozen=True, slots=True)
class AllToAllNoC:
    """Every core reaches every other core directly; transfers serialise only at the sender's
    injection port and the receiver's ejection port (ELK §2.2, the IPU exchange)."""

    injection_bytes_per_cycle: float
    ejection_bytes_per_cycle: float
    latency_cycles: int
    kind: Literal["all_to_all"] = "all_to_all"


NoC = MeshNoC | AllToAllNoC


@dataclass(frozen=True, slots=True)
class Chip:
    """A whole chip: ``num_cores`` identical cores, an HBM, a NoC, a clock.  ``execution``: how
    a layer runs on it by default — ``"spatial"`` (a dataflow accelerator: the STeP program's
    operators placed on the cores) or ``"kernel"`` (an inter-core-connected chip: operator by
    operator, ELK schedules)."""

    name: str
    clock_ghz: float
    num_cores: int
    core: CoreSpec
    hbm: HbmSpec
    noc: NoC
    description: str = ""
    sources: tuple[str, ...] = field(default=())
    execution: Literal["spatial", "kernel"] = "spatial"

    def cycles_to_seconds(self, cycles: float) -> float:
        """Wall-clock time of ``cycles`` at this chip's clock."""
        return cycles / (self.clock_ghz * 1e9)

    def mesh_coords(self, core: int) -> tuple[int, int]:
        """``(row, col)`` of ``core`` on a mesh NoC (``divmod(core, cols)``)."""
        if not isinstance(self.noc, MeshNoC):
            raise ChipConfigError(
                f"chip {self.name!r} has an all-to-all NoC: cores have no mesh coordinates"
            )
        if not 0 <= core < self.num_cores:
            raise ChipConfigError(f"core {core} is out of range 0..{self.num_cores - 1}")
        return divmod(core, self.noc.cols)

    def core_at(self, row: int, col: int) -> int:
        """The core id at mesh position ``(row, col)`` (inverse of :meth:`mesh_coords`)."""
        if not isinstance(self.noc, MeshNoC):
            raise ChipConfigError(
                f"chip {self.name!r} has an all-to-all NoC: cores have no mesh coordinates"
            )
        if not (0 <= row < self.noc.rows and 0 <= col < self.noc.cols):
            raise ChipConfigError(
                f"mesh position ({row}, {col}) is outside the {self.noc.rows}x{self.noc.cols} mesh"
            )
        return row * self.noc.cols + col
