"""What ELK's cost model needs of a chip (ELK §4.3, §5): worker cores, per-core compute, SRAM
and port bandwidth, network latency, and the HBM bandwidth the network can deliver (on a mesh
with edge-attached controllers, what the links next to the edges carry; per grid, the busiest
link of the routes between the controllers and the grid's cores, :mod:`elk.meshlinks`)."""

from __future__ import annotations

from dataclasses import dataclass

from elk.errors import ElkError
from elk.meshlinks import MeshLinks
from hwmodel.chip import AllToAllNoC, Chip, MeshNoC

__all__ = ["ChipCosts"]


@dataclass(frozen=True, slots=True)
class ChipCosts:
    """What the cost model needs of a chip.  One core (the last) is kept for the execute /
    preload synchronisation (ELK §4.5), so ``cores`` is one less than the chip's."""

    name: str
    cores: int
    flops: float
    sram: int
    sram_bw: float
    port: float
    net_lat: float
    hbm_bw: float
    hbm_peak: float
    hbm_lat: float
    mesh: tuple[int, int] | None
    clock_ghz: float
    links: MeshLinks | None = None

    @staticmethod
    def from_chip(chip: Chip, dtype: str = "bf16") -> ChipCosts:
        noc = chip.noc
        hbm = chip.hbm
        cores = chip.num_cores - 1
        links = None
        if isinstance(noc, AllToAllNoC):
            port = min(noc.injection_bytes_per_cycle, noc.ejection_bytes_per_cycle)
            lat, mesh = float(noc.latency_cycles), None
            bw = min(hbm.bytes_per_cycle, cores * noc.ejection_bytes_per_cycle)
        elif isinstance(noc, MeshNoC):
            # the last mesh row is left to the controller core (ELK §4.5 synchronisation)
            port, lat = noc.link_bytes_per_cycle, float(noc.hop_latency_cycles)
            mesh = (noc.rows - 1, noc.cols)
            cores = mesh[0] * mesh[1]
            bw = hbm.bytes_per_cycle
            if hbm.attach_cores:
                cols = {a % noc.cols for a in hbm.attach_cores}
                if cols <= {0, noc.cols - 1}:
                    # edge-attached controllers: all data for the inner columns crosses the
                    # links next to the edge columns (rows links per edge), plus the edge cores
                    cut = len(cols) * noc.rows * noc.link_bytes_per_cycle
                    bw = min(bw, cut * noc.cols / max(1, noc.cols - len(cols)))
                else:
                    bw = min(bw, len(hbm.attach_cores) * 4 * noc.link_bytes_per_cycle)
            links = MeshLinks(
                noc.rows,
                noc.cols,
                tuple(divmod(a, noc.cols) for a in hbm.attach_cores),
                noc.routing,
            )
        else:  # pragma: no cover - closed union
            raise ElkError(f"chip {chip.name!r}: unknown network {noc!r}")
        return ChipCosts(
            chip.name,
            cores,
            float(chip.core.flops(dtype)),
            chip.core.sram_bytes,
            float(chip.core.sram_bytes_per_cycle),
            float(port),
            lat,
            float(bw),
            float(hbm.bytes_per_cycle),
            float(hbm.latency_cycles),
            mesh,
            chip.clock_ghz,
            links,
        )

    #: Share of the aggregate SRAM the planner fills: tiles are whole per core, so placing the
    #: resident operators never balances every core exactly (lowering.elk_placement.place).
    FILL = 0.95

    @property
    def capacity(self) -> int:
        """On-chip bytes the planner may use (``FILL`` of the usable cores' SRAM)."""
        return int(self.FILL * self.cores * self.sram)

    @property
    def rho(self) -> float:
        """Share of a core's port a full-speed preload occupies."""
        return min(0.9, self.hbm_bw / self.cores / self.port)

    def msg(self, nbytes: float, hops: float = 1.0) -> float:
        """Cycles of one message of ``nbytes`` over ``hops`` links."""
        return nbytes / self.port + self.net_lat * hops

    @property
    def edge_fed(self) -> bool:
        """A mesh whose HBM data enters through the controllers' routers (per-link loads)."""
        return self.links is not None and bool(self.links.attach)

    def hbm_link(
        self,
        per_core_bytes: float,
        grid: tuple[int, int],
        store: bool = False,
        in_turn: bool = False,
        top: int | None = None,
    ) -> float:
        """Cycles the mesh links take while an ``h x w`` grid (from mesh row ``top``, default
        its place, :func:`elk.grids.mesh_top`) loads (``store``: stores) ``per_core_bytes``
        per core spread over the HBM channels: the busiest link's traffic over its bandwidth (:meth:`MeshLinks.hbm_pairs`).  ``in_turn``:
        the cores issue their loads in turn as the controller's go token reaches them (every
        preload but those issued before the first execute, ELK §4.5), else all at once; the
        channels serve the cores in that order and a column link receives a core's data only
        once the edge row links have delivered it (:meth:`MeshLinks.preload_span`, a two-stage
        flow shop).  The core's own port on other chips."""
        one = per_core_bytes / self.port
        if not self.edge_fed:
            return one
        assert self.links is not None
        if store:
            return max(one, one * self.links.hbm_pairs(grid[0], grid[1], True, top))
        return max(one, one * self.links.preload_span(grid[0], grid[1], in_turn, top))

    def gather(self, per_dest_bytes: float, grid: tuple[int, int]) -> float:
        """Cycles the busiest link carries while the first column of an ``h x w`` grid gathers
        ``per_dest_bytes`` per core from the cores the previous operator left its output on
        (ELK §4.5; on a mesh the routes into one grid column share its links,
        :meth:`MeshLinks.gather_pairs`; elsewhere the receiving port)."""
        one = per_dest_bytes / self.port
        if self.links is None:
            return one
        return max(one, per_dest_bytes * self.links.gather_pairs(grid[0], grid[1]) / self.port)

    def hbm_hops(self, grid: tuple[int, int]) -> float:
        """Latency cycles of the longest route between a controller and an ``h x w`` grid's
        cores (mesh: hops across the grid's span plus the edge column; else the network
        latency)."""
        if not self.edge_fed:
            return self.net_lat
        assert self.links is not None
        return self.net_lat * (max(grid[1], self.links.cols - grid[1]) + self.links.rows)

    def load(
        self,
        total_bytes: float,
        per_core_bytes: float,
        pieces: int = 8,
        grid: tuple[int, int] | None = None,
        in_turn: bool = True,
    ) -> float:
        """Cycles to preload ``total_bytes`` spread as ``per_core_bytes`` per core in ``pieces``
        loads (ELK §4.2: the HBM roofline or the interconnect delivery, whichever is larger;
        a core's port serialises its pieces, so the first piece's port time is not hidden).
        On a mesh fed from edge controllers the delivery is the busiest link of the routes to
        the cores of ``grid`` (:meth:`hbm_link`; ELK §6.4: HBM data takes multiple hops), the
        HBM roofline that of the channels; ``in_turn``: issued as the go token reaches the
        cores (:meth:`hbm_link`), else all at once (before the first execute)."""
        if total_bytes <= 0:
            return 0.0
        port = per_core_bytes / self.port
        if self.edge_fed and grid is not None:
            net = self.hbm_link(per_core_bytes, grid, in_turn=in_turn)
            return (
                max(total_bytes / self.hbm_peak, net)
                + port / pieces
                + self.hbm_lat
                + self.hbm_hops(grid)
            )
        return max(total_bytes / self.hbm_bw, port) + port / pieces + self.hbm_lat + self.net_lat
