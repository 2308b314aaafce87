"""Closed-form cycle counts of simple spatial pipelines on the ``step-sda`` chip.

The rules (seed 000 §4.2 and the simulator's documented timing, runtime/engine.py, ops.py,
network.py, layout.py), with the chip's numbers:

* an HBM access of a tile laid out on whole interleave granules takes ``interleave /
  per-channel bandwidth`` cycles on each of its channels, in parallel, plus the HBM latency
  (``H`` = 256 / 32 + 160 = 168 cycles); the first 16 tiles of a tensor fall on distinct
  channels, and a load unit keeps up to 16 accesses in flight;
* a message of ``B`` bytes occupies the first link ``B / link bandwidth`` cycles and arrives
  one hop latency after its tail leaves (``X`` = 512 / 64 = 8 cycles, ``h`` = 1: units placed
  along the Hilbert walk are neighbours);
* a Map spends ``max(1, ceil(FLOPs / compute bandwidth))`` cycles per element;
* a FIFO slot frees when the receiver takes the message.
"""

from __future__ import annotations

import pytest
from spatial_graphs import load_store, map_chain, two_stage

from hwmodel import load_chip
from torch2step.spatial import UnitConfig, simulate_graph

CHIP = load_chip("step-sda")
HBM = (
    CHIP.hbm.interleave_bytes // int(CHIP.hbm.bytes_per_cycle_per_channel) + CHIP.hbm.latency_cycles
)
TILE_BYTES = 16 * 16 * 2  # a 16x16 bf16 tile
LINK = TILE_BYTES // int(CHIP.noc.link_bytes_per_cycle)
HOP = CHIP.noc.hop_latency_cycles


def _neighbours(res, *names: str) -> None:  # type: ignore[no-untyped-def]
    """The closed forms assume consecutive units one hop apart."""
    cols = CHIP.noc.cols
    cores = [res.placement.core(n) for n in names]
    for a, b in zip(cores, cores[1:]):
        (ra, ca), (rb, cb) = divmod(a, cols), divmod(b, cols)
        assert abs(ra - rb) + abs(ca - cb) == 1, (names, cores)


def test_constants_of_the_chip() -> None:
    assert (HBM, LINK, HOP) == (168, 8, 1)


@pytest.mark.parametrize("tiles", [1, 4, 16])
def test_load_store_is_hbm_latency_plus_link_stream(tiles: int) -> None:
    """All loads are in flight at once, done at ``H``; the tiles then leave one per ``X``
    cycles; the last store completes ``H`` after the last tile arrives."""
    prog, run = load_store(tiles)
    res = simulate_graph(prog, CHIP, run)
    _neighbours(res, "ld", "st")
    assert res.cycles == HBM + tiles * LINK + HOP + HBM
    assert res.hbm_bytes == 2 * tiles * TILE_BYTES == run.offchip_bytes


@pytest.mark.parametrize(("depth", "per_tile"), [(1, LINK + HOP), (2, LINK), (4, LINK)])
def test_fifo_depth_one_exposes_the_hop(depth: int, per_tile: int) -> None:
    """With one FIFO slot the next tile waits until the previous one arrived (``X + h`` per
    tile); two slots hide the hop latency (``X`` per tile), more change nothing."""
    prog, run = load_store(16)
    res = simulate_graph(prog, CHIP, run, fifo_depth=depth)
    first_hop = 0 if depth == 1 else HOP
    assert res.cycles == 2 * HBM + 16 * per_tile + first_hop


@pytest.mark.parametrize("slow", ["m0", "m1"])
@pytest.mark.parametrize("cycles", [16, 32])
def test_slowest_map_sets_the_throughput(slow: str, cycles: int) -> None:
    """load -> exp -> exp -> store with one Map given ``256 / cycles`` FLOPs/cycle (an exp on a
    16x16 tile is 256 FLOPs): after the pipeline fills, one tile leaves every ``cycles``."""
    prog, run = map_chain(16, ["exp", "exp"])
    assert run.flops["m0"] == 16 * 256
    cfg = {slow: UnitConfig(flops_per_cycle=256 // cycles)}
    res = simulate_graph(prog, CHIP, run, configs=cfg)
    _neighbours(res, "ld", "m0", "m1", "st")
    fast = 1  # the other Map: 256 FLOPs at 2048 FLOPs/cycle
    assert res.cycles == 2 * HBM + 3 * (LINK + HOP) + fast + 16 * cycles
    assert res.unit(slow).busy == 16 * cycles
    other = "m1" if slow == "m0" else "m0"
    assert res.unit(other).busy == 16 * fast


def test_memory_bound_map_uses_the_memory_unit_bandwidth() -> None:
    """``reads_memory``: an element costs ``bytes / on-chip memory bandwidth`` (seed 000 §4.2
    first term; 512 B at 64 B/cycle = 8 cycles) when that exceeds its compute time."""
    prog, run = map_chain(16, ["exp"])
    cfg = {"m0": UnitConfig(reads_memory=True, writes_memory=True)}
    res = simulate_graph(prog, CHIP, run, configs=cfg)
    assert res.unit("m0").busy == 16 * TILE_BYTES // CHIP.core.sram_bytes_per_cycle


def test_two_stages_through_hbm_run_one_after_the_other() -> None:
    """load a -> exp -> store t; load t -> exp -> store o: the second load waits for the
    completion token of the first store (one 4-byte control message, one hop: ``h + 1``
    cycles), so the latency is the two stages' latencies plus the token's."""
    alone, alone_run = map_chain(16, ["exp"])
    stage = simulate_graph(alone, CHIP, alone_run).cycles
    assert stage == 2 * HBM + 2 * (LINK + HOP) + 1 + 15 * LINK  # the exp takes 1 cycle
    prog, run = two_stage(16)
    res = simulate_graph(prog, CHIP, run)
    _neighbours(res, "st1", "ld2")
    token = HOP + 1
    assert res.cycles == 2 * stage + token
    assert res.unit("ld2").stall_recv == stage + token  # waits for the token, then streams
    assert res.unit("st1").finish == stage + 1  # the fence, then the token leaves the core


def test_only_dependent_loads_wait() -> None:
    """The same two pipelines on unrelated tensors run side by side: no token, no fence, and
    the latency stays far below the sum of the stages."""
    prog, run = map_chain(16, ["exp"])
    single = simulate_graph(prog, CHIP, run).cycles
    prog2, run2 = two_stage(16, chained=False)
    res = simulate_graph(prog2, CHIP, run2)
    assert res.plan.programs.barriers == ()
    assert single <= res.cycles < single + HBM
    dep, dep_run = two_stage(16)
    chained = simulate_graph(dep, CHIP, dep_run)
    assert chained.plan.programs.barriers == (("st1.fence", (chained.placement.core("st1"),)),)
    assert [c.name for c in chained.plan.programs.channels if c.name.endswith(".done")] == [
        "st1.done"
    ]
