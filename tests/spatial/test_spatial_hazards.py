"""Read-after-write through HBM between sub-programs of one graph (completion tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from spatial_graphs import two_stage

from hwmodel import load_chip
from lowering.isa import Barrier, RecvValue, SendValue
from torch2step.errors import LoweringError
from torch2step.spatial import OffChipDep, offchip_deps, simulate_graph
from torch2step.spatial.context import TensorLayout
from torch2step.step import Graph, TileType, run
from torch2step.step.interp_context import tile_slice

CHIP = load_chip("step-sda")


def _last_instrs(res, node: str, n: int) -> tuple:  # type: ignore[no-untyped-def]
    core = res.placement.core(node)
    prog = next(p for p in res.plan.programs.programs if p.core == core)
    return prog.body[-n:]


def test_dependences_follow_program_order() -> None:
    prog, _ = two_stage(2)
    assert offchip_deps(prog) == (OffChipDep("t", "st1", ("ld2",)),)
    g = Graph("append")
    cache = g.tensor("cache", (32, 16), "bf16")
    new = g.tensor("new", (16, 16), "bf16")
    out = g.tensor("out", (32, 16), "bf16")
    g.linear_store(g.map("exp", g.linear_load(cache, (16, 16), name="old")), out, name="st_out")
    g.linear_store(g.linear_load(new, (16, 16), name="ld_new"), cache, base=1, name="append")
    # the cache is read before the append in program order: an input, already present
    assert offchip_deps(g.build()) == ()


def test_store_fences_then_notifies_and_load_waits_first() -> None:
    prog, run_ = two_stage(4)
    res = simulate_graph(prog, CHIP, run_)
    assert _last_instrs(res, "st1", 2) == (Barrier("st1.fence"), SendValue("st1.done", 1))
    core = res.placement.core("ld2")
    body = next(p for p in res.plan.programs.programs if p.core == core).body
    first_load = next(i for i, ins in enumerate(body) if type(ins).__name__ == "Load")
    assert RecvValue("st1.done", "done.st1.done") in body[:first_load]
    assert res.unit("ld2").finish > res.unit("st1").finish


def _random_chain(addresses: list[int]) -> tuple:
    """Stage 1 writes tensor t with a RandomOffChipStore at addresses 3, 2, 1, 0; stage 2 reads
    the tiles of t named by the input stream ``addr`` with a RandomOffChipLoad."""
    g = Graph("random_chain")
    a = g.tensor("a", (64, 16), "bf16")
    t = g.tensor("t", (64, 16), "bf16")
    o = g.tensor("o", (64, 16), "bf16")
    w = g.tensor("w", (4, 1), "int32")
    waddr = g.linear_load(w, (1, 1), out_shape=(4,), stride=(1,), name="ld_w")
    data = g.linear_load(a, (16, 16), out_shape=(4,), stride=(1,), name="ld_a")
    g.random_store(waddr, data, t, name="scatter")
    addr = g.input("addr", TileType((1, 1), "int32"), (len(addresses),))
    g.linear_store(g.random_load(addr, t, (16, 16), name="gather"), o, name="st")
    prog = g.build()
    streams = {"addr": [np.full((1, 1), x, np.int32) for x in addresses]}
    tensors = {
        "a": np.ones((64, 16), np.float32),
        "w": np.array([[3], [2], [1], [0]], np.int32),
    }
    return prog, run(prog, tensors=tensors, streams=streams)


def test_random_store_then_random_load() -> None:
    prog, run_ = _random_chain([0, 3, 1])
    assert offchip_deps(prog) == (OffChipDep("t", "scatter", ("gather",)),)
    res = simulate_graph(prog, CHIP, run_)
    assert res.hbm_bytes == run_.offchip_bytes
    gather = res.unit("gather")
    assert gather.stall_recv >= res.unit("scatter").finish  # waited for the token
    assert res.cycles == res.unit("st").finish


def test_a_load_that_never_loads_still_takes_its_token() -> None:
    """An empty address stream: the gather unit accesses nothing, receives the token at its
    end, and the run completes (no message is left unreceived)."""
    prog, run_ = _random_chain([])
    res = simulate_graph(prog, CHIP, run_)
    assert _last_instrs(res, "gather", 1) == (RecvValue("scatter.done", "done.scatter.done"),)
    assert res.unit("gather").received == 0
    assert res.hbm_bytes == run_.offchip_bytes


def test_residual_across_the_token_is_buffered() -> None:
    """load a -> exp (x) -> store t; load t -> add(., x) -> store o: the second stage reads x
    directly as well, so x's FIFO to it fills while it waits for the token; the simulation
    deepens exactly that channel and completes."""
    g = Graph("residual")
    a = g.tensor("a", (16 * 8, 16), "bf16")
    t = g.tensor("t", (16 * 8, 16), "bf16")
    o = g.tensor("o", (16 * 8, 16), "bf16")
    x = g.map("exp", g.linear_load(a, (16, 16), name="ld1"), name="x")
    g.linear_store(x, t, name="st1")
    y = g.map("add", g.linear_load(t, (16, 16), name="ld2"), x, name="y")
    g.linear_store(y, o, name="st2")
    prog = g.build()
    run_ = run(prog, tensors={"a": np.zeros((128, 16), np.float32)})
    res = simulate_graph(prog, CHIP, run_)
    assert res.deep_channels == ("x",)
    assert res.hbm_bytes == run_.offchip_bytes
    assert res.unit("ld2").stall_recv >= res.unit("st1").finish


def _retiled(tile2: tuple[int, int]) -> tuple:
    """Store t in [1, 32] row tiles, read it back in ``tile2`` tiles."""
    g = Graph("retiled")
    a = g.tensor("a", (8, 32), "bf16")
    t = g.tensor("t", (8, 32), "bf16")
    o = g.tensor("o", (8, 32), "bf16")
    g.linear_store(g.linear_load(a, (1, 32), name="ld1"), t, name="st1")
    g.linear_store(g.linear_load(t, tile2, name="ld2"), o, name="st2")
    prog = g.build()
    return prog, run(prog, tensors={"a": np.arange(256, dtype=np.float32).reshape(8, 32)})


def test_tensor_read_in_other_tiles_is_row_major() -> None:
    """t is written in [1, 32] rows and read in [1, 16] halves: it is laid out row-major and
    every half-row is the contiguous range the interpreter reads."""
    prog, run_ = _retiled((1, 16))
    res = simulate_graph(prog, CHIP, run_)
    assert res.hbm_bytes == run_.offchip_bytes
    lay = res.plan.programs.tensors
    assert [d.shape for d in lay if d.name == "t"] == [(256,)]
    assert res.unit("ld2").stall_recv >= res.unit("st1").finish  # waited for the token


@pytest.mark.parametrize(
    ("shape", "tile"), [((8, 32), (1, 16)), ((8, 32), (4, 32)), ((2, 6, 32), (3, 32))]
)
def test_row_major_regions_are_the_interpreters_tiles(shape: tuple, tile: tuple) -> None:
    """Every tile's element range in the row-major layout holds exactly the elements the
    reference interpreter reads for that tile number."""
    arr = np.arange(int(np.prod(shape))).reshape(shape)
    lay = TensorLayout("t", "bf16", shape, None)
    grid = [*shape[:-2], shape[-2] // tile[0], shape[-1] // tile[1]]
    for lin in range(int(np.prod(grid))):
        (start,), (n,) = lay.region(lin, tile)
        want = arr[tile_slice(arr, grid, lin, tile, "test")].ravel()
        assert list(want) == list(range(start, start + n)), lin


def test_multi_row_partial_tiles_cannot_mix() -> None:
    prog, run_ = _retiled((2, 16))
    with pytest.raises(LoweringError, match=r"tensor t \[8, 32\] is accessed in tiles"):
        simulate_graph(prog, CHIP, run_)
