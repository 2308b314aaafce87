"""The mesh against the all-to-all chip as ELK Fig. 21 compares them (ELK §6.4 (1)).

ELK plots interconnect utilisation as the cycles the interconnect is busy over the step's
cycles (:meth:`elk.plan.ElkSchedule.noc_utilisation`): a preload's delivery keeps it busy for
as long as its bottleneck carries the preload's bytes, an execution for its exchange.  "Since
mesh takes multiple hops to deliver HBM data to cores", a mesh is busier than an all-to-all
chip of the same ports for the same bytes; ELK also finds both "achieving similar serving
latencies", which needs a mesh whose edge links carry the HBM bandwidth.  :func:`mesh_note`
says how far the mesh preset is from that, from its links (ELK §6.1: every link has the
emulator's bandwidth; ELK §5: the HBM controllers sit on the mesh edges); :func:`fig21` pairs
the two chips' rows of one model and batch.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from elk.chipcosts import ChipCosts
from elk.grids import footprint
from elk.meshlinks import MeshLinks
from elk.plan import ElkSchedule

__all__ = ["delivery_rate", "four_edge_links", "mesh_note", "fig21"]


def delivery_rate(links: MeshLinks, grid: tuple[int, int], port: float) -> float:
    """Bytes per cycle the mesh delivers from its controllers to every core of ``grid``
    (at its place, :func:`elk.grids.mesh_top`) when each core's share is spread evenly over
    the channels: the grid's cores times the link bandwidth over the busiest link's share
    (:meth:`MeshLinks.hbm_pairs`)."""
    h, w = grid
    return port * h * w / max(1.0, links.hbm_pairs(h, w))


@lru_cache(maxsize=8)
def four_edge_links(links: MeshLinks) -> MeshLinks:
    """The same channels spread evenly over all four edges of the mesh (a quarter per edge,
    each edge's share spread evenly along its routers between the corners) instead of the
    west and east edges."""
    n, rows, cols = len(links.attach), links.rows, links.cols
    per = [n // 4 + (1 if k < n % 4 else 0) for k in range(4)]
    attach: list[tuple[int, int]] = []
    for side, count in enumerate(per):
        span = (rows if side < 2 else cols) - 2  # the edge's routers but the corners
        for j in range(count):
            pos = 1 + (2 * j + 1) * span // (2 * count)
            attach.append(((pos, 0), (pos, cols - 1), (0, pos), (rows - 1, pos))[side])
    return MeshLinks(rows, cols, tuple(attach), links.routing)


def mesh_note(s: dict[str, ElkSchedule]) -> str:
    """Why the edge-fed mesh's interconnect is busy and its step slow, from its links: the
    heaviest preload's routes, the delivery rate of the whole mesh, and the link bandwidth ELK
    Fig. 21's "similar serving latencies" would need (ELK §6.4)."""
    full, basic = s["elk_full"], s["basic"]
    c: ChipCosts = full.costs
    assert c.mesh is not None and c.links is not None
    k = max(range(len(full.ops)), key=lambda j: full.ops[j].hbm_bytes)
    op, plan = full.ops[k], full.plans[k]
    h, w = footprint(plan, c.mesh)
    whole = delivery_rate(c.links, c.mesh, c.port)
    four = delivery_rate(four_edge_links(c.links), c.mesh, c.port)
    # a preload's interconnect cycles per byte against an all-to-all chip of the same ports
    busier = full.noc_busy(k) * c.cores * c.port / op.hbm_bytes
    need = c.port * c.hbm_peak / whole
    bd = basic.breakdown()
    util = ", ".join(f"{d} {s[d].noc_utilisation():.0%}" for d in ("basic", "static", "elk_full"))
    return (
        "interconnect utilisation counted as ELK Fig. 21 does (cycles the interconnect is busy "
        "over the step's cycles; a delivery keeps it busy while its busiest link carries it, "
        f"an execution for its exchange): {util}; {op.name.split('.')[-1]}'s preload to its "
        f"{h}x{w} grid keeps it busy {busier:.1f}x as long as the same bytes on an all-to-all "
        f"chip of the same ports (each byte crosses {c.links.hbm_hops(h, w):.0f} links, the "
        "busiest of them carries "
        f"{c.links.hbm_pairs(h, w):.1f} cores' whole shares), which is ELK's 'mesh takes "
        f"multiple hops to deliver HBM data'.  The {len(c.links.attach)} channels enter at the "
        f"west and east edge routers, and with {c.port:.3f}-byte/cycle links (ELK §6.1: every "
        "link has the emulator's 5.5 GB/s) the mesh delivers "
        f"{whole:.0f} of the HBM's {c.hbm_peak:.0f} bytes/cycle to all its cores (spread over "
        f"all four edges instead, {four:.0f}: XY routing runs the north and south channels' "
        "data along the edge rows first), so every design is bound by the edge links (Basic "
        f"{(bd['interconnect'] + bd['preload']) / basic.cycles:.0%} of its time preload-bound "
        "or held up behind preloads) and the step is many times slower than on the all-to-all "
        "chip.  ELK Fig. 21's 'similar serving latencies' need links of about "
        f"{need:.0f} bytes/cycle ({need / c.port:.0f}x the stated link bandwidth) to carry the "
        "HBM bandwidth from the edges: not reachable with the paper's own link bandwidth and "
        "edge-attached controllers, so here the mesh is busier and slower"
    )


def fig21(rows: dict[str, dict[str, dict[str, Any]]], mesh: str, a2a: str) -> dict[str, Any]:
    """ELK Fig. 21's comparison of one model and batch: per design (Ideal left out, as ELK
    does: it has separate interconnects) the interconnect utilisation on the mesh and on the
    all-to-all chip and the mesh's latency over the all-to-all's; ``rows``: the benchmark's
    rows per chip and design."""
    out: dict[str, Any] = {"mesh": mesh, "all_to_all": a2a, "noc_util": {}, "latency_ratio": {}}
    for d, r in rows[mesh].items():
        if d == "ideal" or d not in rows[a2a]:
            continue
        o = rows[a2a][d]
        out["noc_util"][d] = [r["noc_util"], o["noc_util"]]
        out["latency_ratio"][d] = round(r["latency_ms"] / o["latency_ms"], 2)
    out["mesh_busier"] = all(m > a for m, a in out["noc_util"].values())
    return out
