"""The per-unit timing model of the STeP simulator (STeP §4.2) on a chip of ``hwmodel``.

Higher-order operators (Map, Accum, Scan, FlatMap) are allocated a compute bandwidth
(FLOPs/cycle: the core's rate unless :class:`UnitConfig` says otherwise).  On each input element
a unit spends::

    max(input bytes / on-chip memory BW,  FLOPs / compute BW,  output bytes / on-chip memory BW)

cycles, where the first and last terms are zero when the data streams directly between units
(the default; ``UnitConfig(reads_memory=True / writes_memory=True)`` is the STeP artifact's
``read_from_mu`` / ``write_back_mu``).  FLOPs come from the STeP tile function's own count
(:meth:`FnSpec.flops_of`) on the element's actual tile shapes, so dynamically sized tiles cost
what they hold.  On-chip memory BW is the core's ``sram_bytes_per_cycle`` (STeP §5.1: 64
bytes/cycle per memory unit).  Every unit step takes at least one cycle ("for the remaining
operators, we assume a single cycle latency").  Off-chip operators are timed by the simulator's
HBM model; channels by its NoC model.

The cycles are carried by a Compute of the ``step_unit`` kernel: its FLOP count is the cycle
count times the core rate of the instruction's dtype, so the simulator's compute term gives the
cycles exactly.  A step on a tile of dynamic rows carries a :class:`RowRule` instead of literal
cycles and sizes (:mod:`.rows`): the kernel computes both from the rows of the input tile it
is given, so one instruction costs what each tile it receives holds.  The simulator's own SRAM
term (which charges every byte a kernel touches) would
double-count what the roofline above already decides, so spatial programs run on
:func:`simulation_chip`, a copy of the chip whose per-core SRAM bandwidth does not bind.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hwmodel.chip import AllToAllNoC, Chip
from lowering.kernels import KERNELS, Kernel, register_kernel
from torch2step.step.evaluate import evaluate
from torch2step.step.functions import Fn, unpack_args
from torch2step.step.ops_compute import update_args
from torch2step.step.types import DataType, TileType, TupleType

__all__ = [
    "STEP_KERNEL",
    "RowRule",
    "UnitConfig",
    "TimingModel",
    "simulation_chip",
    "concrete_type",
]

#: Name of the kernel every spatial unit's Compute runs.
STEP_KERNEL = "step_unit"

#: A per-core SRAM bandwidth that never binds (see the module docstring).
_UNBOUNDED_BW = 1 << 40


def _rows(shapes: Sequence[tuple[int, ...]], params: Any) -> int:
    """Rows of the input tile a row rule follows (messages are flat: elements over columns)."""
    return math.prod(shapes[int(params["row_in"])]) // int(params["cols"])


def _linear(form: str, rows: int) -> int:
    """``a*rows + c`` of a form ``"a:c"`` (a plain integer is a constant)."""
    if ":" not in form:
        return int(form)
    a, c = form.split(":")
    return int(a) * rows + int(c)


def _out_shapes(shapes: Sequence[tuple[int, ...]], params: Any) -> tuple[tuple[int, ...], ...]:
    text = str(params.get("outs", ""))
    forms = [x for x in text.split(",") if x]
    if "row_in" not in params:
        return tuple((int(x),) for x in forms)
    rows = _rows(shapes, params)
    return tuple((_linear(x, rows),) for x in forms)


def _cycles(shapes: Sequence[tuple[int, ...]], params: Any) -> int:
    """The step's cycles: a literal, or under a row rule ``max(1, ceil((a*rows + c) / d))``
    over the rule's terms ``"a:c:d;..."`` (FLOPs over the unit's compute bandwidth, bytes over
    the on-chip memory bandwidth: the roofline of :meth:`TimingModel.roofline`)."""
    cyc = params["cycles"]
    if "row_in" not in params:
        return int(cyc)
    rows = _rows(shapes, params)
    best = 1
    for term in filter(None, str(cyc).split(";")):
        a, c, d = (int(v) for v in term.split(":"))
        best = max(best, -(-(a * rows + c) // d))
    return best


def _run(ins: Sequence[np.ndarray], params: Any) -> tuple[np.ndarray, ...]:
    return tuple(np.zeros(s, np.float32) for s in _out_shapes([a.shape for a in ins], params))


if STEP_KERNEL not in KERNELS:
    register_kernel(
        Kernel(
            STEP_KERNEL,
            _out_shapes,
            lambda shapes, p: _cycles(shapes, p) * int(p["rate"]),
            _run,
        )
    )


@dataclass(frozen=True, slots=True)
class RowRule:
    """Cycles and output sizes of a unit step as functions of the run-time rows of one input
    tile (a tile whose declared row count is dynamic: the tokens an expert got, a KV tile's
    rows), so the same ``Compute`` costs what the tile it receives holds (STeP §4.2: FLOPs of
    the element's actual shapes).

    ``slot``: the part of the step's first input element holding the tile; ``cols``: its
    columns; ``terms``: ``(a, c, d)`` with cycles ``max(1, ceil((a*rows + c) / d))`` over the
    terms; ``outs``: per output part ``(a, c)`` with ``a*rows + c`` elements."""

    slot: int
    cols: int
    terms: tuple[tuple[int, int, int], ...]
    outs: tuple[tuple[int, int], ...]

    def params(self, row_in: int, rate: int) -> tuple[tuple[str, int | str], ...]:
        """The ``step_unit`` parameters of the rule, the tile being input ``row_in``."""
        return (
            ("cols", self.cols),
            ("cycles", ";".join(f"{a}:{c}:{d}" for a, c, d in self.terms)),
            ("outs", ",".join(f"{a}:{c}" for a, c in self.outs)),
            ("rate", rate),
            ("row_in", row_in),
        )

    def cycles(self, rows: int) -> int:
        """Cycles of the step on a tile of ``rows`` rows."""
        return max([1] + [-(-(a * rows + c) // d) for a, c, d in self.terms])


@dataclass(frozen=True, slots=True)
class UnitConfig:
    """Parameters of one unit (STeP §4.2): ``flops_per_cycle`` is the compute bandwidth
    allocated to it (``None``: the core's rate for the tile dtype); ``reads_memory`` /
    ``writes_memory`` make its inputs / outputs pass through an on-chip memory unit."""

    flops_per_cycle: int | None = None
    reads_memory: bool = False
    writes_memory: bool = False


def concrete_type(x: Any, t: DataType) -> DataType:
    """The declared type ``t`` with the run-time element ``x``'s actual tile shapes."""
    if isinstance(t, TileType) and hasattr(x, "shape"):
        return TileType((int(x.shape[0]), int(x.shape[1])), t.dtype)
    if isinstance(t, TupleType):
        return TupleType(tuple(concrete_type(v, s) for v, s in zip(x, t.elems)))
    return t


class TimingModel:
    """Cycle counts of unit steps on ``chip`` (see the module docstring)."""

    def __init__(self, chip: Chip) -> None:
        self.chip = chip
        rates = dict(chip.core.flops_per_cycle)
        self.rates = rates
        self.enc_dtype = chip.core.flops_per_cycle[0][0]
        self.enc_rate = rates[self.enc_dtype]
        self.default_rate = rates.get("bf16", max(rates.values()))
        self.mem_bw = chip.core.sram_bytes_per_cycle
        noc = chip.noc
        self.link_bw = (
            noc.injection_bytes_per_cycle
            if isinstance(noc, AllToAllNoC)
            else noc.link_bytes_per_cycle
        )
        self._flops: dict[tuple, int] = {}

    def rate(self, dtype: str, cfg: UnitConfig) -> int:
        """Compute bandwidth of a unit working on ``dtype`` tiles: the configured one, else the
        core's rate for ``dtype``, else its 16-bit rate (fp32 STeP tiles on a bf16 fabric run at
        the bf16 rate, as the STeP artifact's ``mock_bf16``)."""
        if cfg.flops_per_cycle is not None:
            return cfg.flops_per_cycle
        return self.rates.get(dtype, self.default_rate)

    def roofline(
        self, flops: int, in_bytes: int, out_bytes: int, rate: int, cfg: UnitConfig
    ) -> int:
        """Cycles of one element (STeP §4.2), at least 1."""
        c = -(-flops // rate) if flops else 0
        if cfg.reads_memory:
            c = max(c, -(-in_bytes // self.mem_bw))
        if cfg.writes_memory:
            c = max(c, -(-out_bytes // self.mem_bw))
        return max(1, c)

    def memory_cycles(self, nbytes: int) -> int:
        """Cycles to read or write ``nbytes`` of an on-chip memory unit (at least 1)."""
        return max(1, -(-nbytes // self.mem_bw))

    def dma_depth(self, tile_bytes: int, limit: int = 16) -> int:
        """Tiles an off-chip unit keeps in flight so one link's worth of tiles per latency is
        covered (Little's law), between 2 (double buffering, STeP §4.1) and ``limit``."""
        hbm = self.chip.hbm
        per_tile = max(1.0, tile_bytes / self.link_bw)
        need = math.ceil((hbm.latency_cycles + tile_bytes / hbm.bytes_per_cycle) / per_tile) + 1
        return min(limit, max(2, need))

    # -- FLOPs of tile functions -------------------------------------------------------------------

    def _eval(self, f: Fn, args: tuple[DataType, ...]) -> int:
        key = (f, args)
        hit = self._flops.get(key)
        if hit is None:
            hit = self._flops[key] = int(evaluate(f.spec.flops_of(f, args)))
        return hit

    def map_flops(self, f: Fn, elem: DataType) -> int:
        """FLOPs of a map or flat function on one (concrete) element."""
        return self._eval(f, unpack_args(f, f.spec, elem))

    def update_flops(self, f: Fn, elem: DataType, state: DataType) -> int:
        """FLOPs of one Accum/Scan update of ``state`` by ``elem`` (concrete types)."""
        return self._eval(f, update_args(f, f.spec, elem, state))


def simulation_chip(chip: Chip, pool: int = 1) -> Chip:
    """``chip`` as the spatial programs run on it: SRAM bandwidth that does not bind (the unit
    roofline decides, see the module docstring) and ``pool`` cores' SRAM per core (a unit with
    extra memory units holds their buffers; each unit's own need is checked at placement)."""
    core = dataclasses.replace(
        chip.core,
        sram_bytes=chip.core.sram_bytes * max(1, pool),
        sram_bytes_per_cycle=_UNBOUNDED_BW,
    )
    return dataclasses.replace(chip, core=core)
