"""Interconnect utilisation as ELK §6.3-§6.4 count it (Fig. 18 (c), Fig. 21): the cycles the
interconnect is busy over the step's cycles, a preload's delivery keeping it busy while its
bottleneck carries it, on the mesh preset against the all-to-all ``ipu-hbm``."""

from __future__ import annotations

import pytest

from elk.chipcosts import ChipCosts
from elk.grids import footprint
from elk.interconnect import delivery_rate, fig21, four_edge_links
from elk.ops import DecoderShape, decode_step_ops, layer_ops
from elk.plan import ElkSchedule, plan_model
from hwmodel.presets import load_chip
from torch2step.kernel.report import KernelReport, simulate_schedule

#: A small decoder layer whose operators take large grids of the mesh.
SMALL = DecoderShape("small", 2048, 16, 4, 128, 4096, 1)


def _plan(chip: str) -> ElkSchedule:
    ops = layer_ops(SMALL, 16, 1024)
    return plan_model(ops, load_chip(chip), "elk_dyn", window=4, beam=2, max_orders=2)


@pytest.fixture(scope="module")
def both() -> tuple[ElkSchedule, ElkSchedule]:
    return _plan("mesh"), _plan("ipu-hbm")


def test_all_to_all_utilisation_is_bytes_over_port_capacity(
    both: tuple[ElkSchedule, ElkSchedule],
) -> None:
    """On the all-to-all chip busy cycles are bytes over the aggregate port bandwidth, so the
    utilisation is every byte crossing a core port over the ports' capacity."""
    _, a2a = both
    c = a2a.costs
    moved = sum(p.xbytes for p in a2a.plans) + sum(op.hbm_bytes for op in a2a.ops)
    assert a2a.noc_utilisation() == pytest.approx(moved / (c.cores * c.port * a2a.cycles))


def test_mesh_delivery_is_busier_per_byte_than_all_to_all(
    both: tuple[ElkSchedule, ElkSchedule],
) -> None:
    """ELK §6.4: "mesh takes multiple hops to deliver HBM data to cores", so every preload
    keeps the edge-fed mesh busy longer than the same bytes keep an all-to-all chip of the
    same port bandwidth busy."""
    mesh, a2a = both
    c = mesh.costs
    heavy = [k for k, op in enumerate(mesh.ops) if op.hbm_bytes]
    assert heavy
    for k in heavy:
        per_mesh = mesh.noc_busy(k) / mesh.ops[k].hbm_bytes
        per_a2a = a2a.noc_busy(k) / a2a.ops[k].hbm_bytes
        assert per_mesh > per_a2a, mesh.ops[k].name
        # longer than the grid's own links would take: the busiest link carries more than
        # one core's share
        h, w = footprint(mesh.plans[k], c.mesh)
        assert per_mesh > 1.5 / (h * w * c.port), mesh.ops[k].name


def test_delivery_busy_time_fits_in_its_preload(both: tuple[ElkSchedule, ElkSchedule]) -> None:
    """A delivery cannot keep the interconnect busy longer than the preload takes: the
    schedule's preload of each operator lasts at least its busiest link's time."""
    for s in both:
        t = s.timeline
        for k in range(len(s.ops)):
            span = t.preload_end[k] - t.preload_start[k]
            assert s.noc_busy(k) <= span + 1e-6, (s.costs.name, s.ops[k].name)


def test_whole_mesh_delivery_rate_agrees_with_the_edge_cut() -> None:
    """The route loads of a whole-mesh preload (:func:`delivery_rate`) and the cut of the
    links next to the edge columns (``ChipCosts.hbm_bw``) bound the mesh's HBM delivery
    alike, within a few percent; spreading the channels over all four edges under XY routing
    delivers less (the north and south channels' data run along the edge rows)."""
    c = ChipCosts.from_chip(load_chip("mesh"))
    assert c.links is not None and c.mesh is not None
    rate = delivery_rate(c.links, c.mesh, c.port)
    assert rate == pytest.approx(c.hbm_bw, rel=0.05)
    assert rate < c.hbm_peak / 5
    four = four_edge_links(c.links)
    assert len(four.attach) == len(c.links.attach)
    on = {
        "w": sum(col == 0 for _, col in four.attach),
        "e": sum(col == four.cols - 1 for _, col in four.attach),
        "n": sum(row == 0 for row, _ in four.attach),
        "s": sum(row == four.rows - 1 for row, _ in four.attach),
    }
    assert on == {"w": 16, "e": 16, "n": 16, "s": 16}
    assert delivery_rate(four, c.mesh, c.port) < rate


def test_fig21_pairs_designs_and_leaves_out_ideal() -> None:
    """:func:`fig21` compares the designs both chips ran, without Ideal."""
    rows = {
        "mesh": {
            "basic": {"noc_util": 0.6, "latency_ms": 10.0},
            "elk_full": {"noc_util": 0.5, "latency_ms": 8.0},
            "ideal": {"noc_util": 0.9, "latency_ms": 6.0},
        },
        "ipu-hbm": {
            "basic": {"noc_util": 0.4, "latency_ms": 2.0},
            "elk_full": {"noc_util": 0.55, "latency_ms": 1.0},
            "ideal": {"noc_util": 0.5, "latency_ms": 1.0},
        },
    }
    f = fig21(rows, "mesh", "ipu-hbm")
    assert set(f["noc_util"]) == {"basic", "elk_full"}
    assert f["latency_ratio"] == {"basic": 5.0, "elk_full": 8.0}
    assert f["mesh_busier"] is False


@pytest.fixture(scope="module")
def simulated() -> dict[str, tuple[ElkSchedule, KernelReport]]:
    """Llama-3-8B's full-size QKV projection (batch 32) planned and simulated on both chips."""
    op = next(o for o in decode_step_ops("llama3-8b", 32, 2048, 1) if o.name.endswith("qkv_proj"))
    out = {}
    for name in ("ipu-hbm", "mesh"):
        chip = load_chip(name)
        s = plan_model([op], chip, "elk_full", window=4, beam=2, max_orders=2)
        out[name] = (s, simulate_schedule(s, chip))
    return out


def test_simulated_utilisation_is_busy_time_as_the_plan_counts_it(
    simulated: dict[str, tuple[ElkSchedule, KernelReport]],
) -> None:
    """The kernel report counts the simulated interconnect as the plan does (ELK Fig. 18 (c)):
    on the all-to-all chip the ejection ports' busy cycles (every byte delivered to a core)
    are the plan's busy cycles (bytes over the cores' port bandwidth); the mean over all
    ports, injection ones and idle ones included, is a lower, separately named figure."""
    s, r = simulated["ipu-hbm"]
    assert r.noc_util * r.cycles == pytest.approx(s.noc_utilisation() * s.cycles, rel=0.05)
    assert r.noc_mean < 0.75 * r.noc_util
    d = r.to_dict()
    assert (d["noc_util"], d["noc_mean_resource_util"]) == (
        round(r.noc_util, 4),
        round(r.noc_mean, 4),
    )
    assert "busy time" in str(r)


def test_simulated_mesh_is_busier_than_all_to_all(
    simulated: dict[str, tuple[ElkSchedule, KernelReport]],
) -> None:
    """ELK Fig. 21 in simulation: the edge-fed mesh's busiest link is busy longer than the
    all-to-all chip's ports for the same preload, within a quarter of the plan's busy cycles
    (the busiest link stands for each delivery's bottleneck)."""
    (ms, mr), (_, ar) = simulated["mesh"], simulated["ipu-hbm"]
    assert mr.noc_util > ar.noc_util
    assert mr.noc_util * mr.cycles == pytest.approx(ms.noc_utilisation() * ms.cycles, rel=0.25)
