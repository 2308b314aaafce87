"""Microbenchmarks with closed-form cycle counts, asserted exactly.

Chip constants (runtime_testkit): HBM 4 channels x 32 B/cycle = 128 B/cycle, latency 100 cycles,
interleave 64 B; mesh links 16 B/cycle, 2 cycles per hop; all-to-all ports 8 B/cycle, latency 10.
"""

from __future__ import annotations

import pytest
from runtime_testkit import a2a_chip, cannon_chip, cannon_cycles, cannon_programs, hbm, mesh_chip

from lowering.isa import (
    Affine,
    Alloc,
    Barrier,
    Channel,
    Compute,
    Load,
    Loop,
    Program,
    ProgramSet,
    Recv,
    Region,
    Send,
    Store,
    TensorDecl,
)
from runtime import simulate


def _stream(core: int, tensor: str, tile_elems: int, tiles: int, first: int = 0) -> Program:
    """Core streams ``tiles`` consecutive bf16 tiles of ``tensor`` starting at tile ``first``."""
    start = Affine(first * tile_elems, (("i", tile_elems),))
    return Program(
        core,
        (
            Alloc("t", (tile_elems,)),
            Loop(tiles, (Load("t", tensor, Region((start,), (tile_elems,))),), var="i"),
        ),
    )


def test_one_core_streams_hbm_at_full_bandwidth():
    # 256 KiB in 4 KiB loads, issued back to back: latency + bytes / (channels * bw).
    n = 256 * 1024
    ps = ProgramSet((_stream(0, "x", 2048, 64),), tensors=(TensorDecl("x", (n // 2,)),))
    r = simulate(ps, mesh_chip(1, 1))
    assert r.cycles == 100 + n // 128
    core = r.stats.core(0)
    assert core.stall_mem == r.cycles and core.busy == 0 and core.idle == 0
    assert [c.busy for c in r.stats.hbm_channels] == [n // 4 // 32] * 4
    assert dict(r.stats.bytes_moved)["hbm_read"] == n


@pytest.mark.parametrize("depth,cycles", [(1, 64 * 132), (2, 32 * 132 + 32), (16, 100 + 64 * 32)])
def test_dma_queue_depth_bounds_outstanding_loads(depth, cycles):
    # 64 loads of 4 KiB: each takes 32 cycles of channel time + 100 latency.  One outstanding
    # request: 64 round trips; two: pairs overlap; sixteen cover the latency (Little's law).
    ps = ProgramSet((_stream(0, "x", 2048, 64),), tensors=(TensorDecl("x", (64 * 2048,)),))
    assert simulate(ps, mesh_chip(1, 1), dma_queue_depth=depth).cycles == cycles


def test_all_cores_reading_hbm_are_bandwidth_bound():
    # 16 cores x 8 KiB at once share 128 B/cycle: latency + total / bandwidth.
    per = 8 * 1024
    progs = tuple(_stream(c, "x", 512, per // 1024, first=c * per // 1024) for c in range(16))
    ps = ProgramSet(progs, tensors=(TensorDecl("x", (16 * per // 2,)),))
    r = simulate(ps, mesh_chip(4, 4))
    assert r.cycles == 100 + 16 * per // 128
    assert max(c.finish for c in r.stats.cores) == r.cycles
    assert all(c.busy == 16 * per // 4 // 32 for c in r.stats.hbm_channels)
    assert r.stats.hbm_utilisation == pytest.approx(1024 / 1124)


def test_unaligned_load_splits_by_address_interleaving():
    # 100 bf16 elements starting at byte 40: bytes [40, 240) over 64-byte granules:
    # ch0 gets 24 (40..64), ch1 64, ch2 64, ch3 48 (192..240).  A channel is busy bytes / 32
    # cycles (exact fractions); the data is there at latency + ceil(max of them).
    ps = ProgramSet(
        (Program(0, (Alloc("t", (100,)), Load("t", "x", Region((20,), (100,))))),),
        tensors=(TensorDecl("x", (1000,)),),
    )
    r = simulate(ps, mesh_chip(1, 1))
    assert [c.bytes for c in r.stats.hbm_channels] == [24, 64, 64, 48]
    assert [c.busy for c in r.stats.hbm_channels] == [0.75, 2, 2, 1.5]
    assert r.cycles == 102


@pytest.mark.parametrize("tiles", [1, 8])
def test_hbm_reads_pass_the_ejection_port_on_all_to_all(tiles):
    # 4 KiB in `tiles` loads: the channels could deliver it in 32 cycles, the 8 B/cycle ejection
    # port needs 512, then hbm latency + exchange latency (seed 002 §2.1: HBM controllers sit on
    # the interconnect).  Loads into one buffer chain without waiting, so the port never idles.
    ps = ProgramSet((_stream(0, "x", 2048 // tiles, tiles),), tensors=(TensorDecl("x", (2048,)),))
    r = simulate(ps, a2a_chip(2))
    assert r.cycles == 100 + 10 + 4096 // 8
    assert r.stats.resource("eject core 0").busy == 512


def test_hbm_writes_pass_the_injection_port_on_all_to_all():
    ps = ProgramSet(
        (Program(0, (Alloc("t", (2048,)), Store("t", "y"))),), tensors=(TensorDecl("y", (2048,)),)
    )
    r = simulate(ps, a2a_chip(2))
    assert r.cycles == 512 + 10 + 100  # port, exchange latency, then the write's latency
    assert r.stats.resource("inject core 0").busy == 512
    assert dict(r.stats.bytes_moved)["hbm_write"] == 4096
    assert r.stats.core(0).stall_mem == r.cycles


def test_hbm_write_behind_mesh_attach_point():
    # core 3 -> channel at core 0: 3 westward links (cut-through), the channel, the latency.
    chip = mesh_chip(1, 4, mem=hbm(channels=1, attach=(0,)))
    ps = ProgramSet(
        (Program(3, (Alloc("t", (256,)), Store("t", "y"))),), tensors=(TensorDecl("y", (256,)),)
    )
    r = simulate(ps, chip)
    assert r.cycles == 3 * 2 + 512 // 16 + 100
    assert [r.stats.resource(f"link r0c{i + 1}->r0c{i} (W)").busy for i in range(3)] == [32] * 3


def test_barrier_releases_everyone_when_the_last_arrives():
    def prog(core: int, k: int) -> Program:
        # matmul (16 x k) @ (k x 16): 2k cycles on 256 bf16 FLOPs/cycle
        return Program(
            core,
            (
                Alloc("a", (16, k)),
                Alloc("b", (k, 16)),
                Alloc("c", (16, 16)),
                Compute("matmul", ("c",), ("a", "b")),
                Barrier("g"),
                Compute("matmul", ("c",), ("a", "b")),
            ),
        )

    ps = ProgramSet((prog(0, 50), prog(1, 5)), barriers=(("g", (0, 1)),))
    r = simulate(ps, mesh_chip(1, 2))
    assert r.cycles == 100 + 100
    assert r.stats.core(1).stall_barrier == 90 and r.stats.core(1).idle == 90
    assert r.stats.core(0).stall_barrier == 0


def test_hbm_behind_mesh_attach_point():
    # One channel attached at core 0 of a 1x4 mesh; core 3 loads 512 B: the data leaves the
    # channel after the latency and crosses 3 links (cut-through): L + 3 hops + 512/16.
    chip = mesh_chip(1, 4, mem=hbm(channels=1, attach=(0,)))
    ps = ProgramSet((_stream(3, "x", 256, 1),), tensors=(TensorDecl("x", (256,)),))
    r = simulate(ps, chip)
    assert r.cycles == 100 + 3 * 2 + 512 // 16
    assert [r.stats.resource(f"link r0c{i}->r0c{i + 1} (E)").busy for i in range(3)] == [32] * 3


def _shared_link(k: int, nbytes: int) -> ProgramSet:
    """Cores 0..k-1 of a 1 x (k+1) mesh each send one message to core k."""
    elems = nbytes // 2
    chans = tuple(Channel(f"c{j}", j, (k,)) for j in range(k))
    progs = [Program(j, (Alloc("m", (elems,)), Send(f"c{j}", "m"))) for j in range(k)]
    recv = [Alloc(f"r{j}", (elems,)) for j in range(k)] + [Recv(f"c{j}", f"r{j}") for j in range(k)]
    progs.append(Program(k, tuple(recv)))
    return ProgramSet(tuple(progs), chans)


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_k_senders_share_one_mesh_link(k):
    # S = 512 B / 16 B/cycle = 32 >= hop latency 2, so the last link into core k is busy
    # back to back from cycle 0: the last message arrives at k*S + hop.
    s, hop = 32, 2
    r = simulate(_shared_link(k, 512), mesh_chip(1, k + 1))
    assert r.cycles == k * s + hop
    # link j -> j+1 carries the messages of cores 0..j
    for j in range(k):
        assert r.stats.resource(f"link r0c{j}->r0c{j + 1} (E)").busy == (j + 1) * s
    assert r.stats.core(k).stall_recv == r.cycles
    for j in range(k):  # every sender's first link is its own at cycle 0
        assert r.stats.core(j).finish == s and r.stats.core(j).stall_send == s


@pytest.mark.parametrize(
    "routing,links",
    [
        ("xy", ["r0c0->r0c1 (E)", "r0c1->r0c2 (E)", "r0c2->r1c2 (S)", "r1c2->r2c2 (S)"]),
        ("yx", ["r0c0->r1c0 (S)", "r1c0->r2c0 (S)", "r2c0->r2c1 (E)", "r2c1->r2c2 (E)"]),
    ],
)
def test_dimension_order_routing(routing, links):
    from dataclasses import replace

    chip = mesh_chip(3, 3)
    chip = replace(chip, noc=replace(chip.noc, routing=routing))
    ps = ProgramSet(
        (
            Program(0, (Alloc("m", (256,)), Send("c", "m"))),
            Program(8, (Alloc("r", (256,)), Recv("c", "r"))),
        ),
        (Channel("c", 0, (8,)),),
    )
    r = simulate(ps, chip)
    assert r.cycles == 4 * 2 + 32
    used = sorted(x.name for x in r.stats.links if x.transfers)
    assert used == sorted(f"link {name}" for name in links)


def test_multicast_crosses_each_link_once():
    # core 0 -> {1, 2, 3} on a 1x4 mesh: one tree, each link carries the 512 B once.
    ps = ProgramSet(
        (Program(0, (Alloc("m", (256,)), Send("c", "m"))),)
        + tuple(Program(d, (Alloc("r", (256,)), Recv("c", "r"))) for d in (1, 2, 3)),
        (Channel("c", 0, (1, 2, 3)),),
    )
    r = simulate(ps, mesh_chip(1, 4))
    assert [r.stats.core(d).finish for d in (1, 2, 3)] == [2 + 32, 4 + 32, 6 + 32]
    assert all(x.busy == 32 for x in r.stats.links if x.transfers)
    assert sum(x.transfers for x in r.stats.links) == 3
    assert dict(r.stats.bytes_moved)["noc_messages"] == 3 * 512


def _exchange(n: int, nbytes: int) -> ProgramSet:
    """All-to-all personalised exchange: in step s core i sends to i+s and receives from i-s."""
    elems = nbytes // 2
    chans = tuple(Channel(f"c{i}_{d}", i, (d,)) for i in range(n) for d in range(n) if d != i)
    progs = []
    for i in range(n):
        body = [Alloc("m", (elems,))]
        body += [Alloc(f"r{s}", (elems,)) for s in range(1, n)]
        body += [Send(f"c{i}_{(i + s) % n}", "m") for s in range(1, n)]
        body += [Recv(f"c{(i - s) % n}_{i}", f"r{s}") for s in range(1, n)]
        progs.append(Program(i, tuple(body)))
    return ProgramSet(tuple(progs), chans)


@pytest.mark.parametrize("n", [2, 5, 8])
def test_all_to_all_exchange(n):
    # Each injection port sends n-1 messages back to back (S = 256 B / 8 = 32 cycles); in step s
    # every receiver gets exactly one message, so ejection never queues: (n-1)*S + latency.
    r = simulate(_exchange(n, 256), a2a_chip(n))
    assert r.cycles == (n - 1) * 32 + 10
    assert all(p.busy == (n - 1) * 32 for p in r.stats.ports)


def test_all_to_all_gather_serialises_at_the_ejection_port():
    k = 6
    chans = tuple(Channel(f"c{j}", j, (k,)) for j in range(k))
    progs = [Program(j, (Alloc("m", (128,)), Send(f"c{j}", "m"))) for j in range(k)]
    progs.append(
        Program(
            k,
            tuple(
                [Alloc(f"r{j}", (128,)) for j in range(k)]
                + [Recv(f"c{j}", f"r{j}") for j in range(k)]
            ),
        )
    )
    r = simulate(ProgramSet(tuple(progs), chans), a2a_chip(k + 1))
    assert r.cycles == 10 + k * 32
    assert r.stats.resource(f"eject core {k}").busy == k * 32


def _pipeline(n: int, depth: int, kp: int, nc: int) -> ProgramSet:
    """Producer (core 0) computes a 16x16 bf16 tile in 2*kp cycles and sends it; consumer (core 1)
    receives it and multiplies it by a 16 x nc matrix in 2*nc cycles."""
    prod = (
        Alloc("a", (16, kp)),
        Alloc("b", (kp, 16)),
        Alloc("x", (16, 16)),
        Loop(n, (Compute("matmul", ("x",), ("a", "b")), Send("ch", "x"))),
    )
    cons = (
        Alloc("y", (16, 16)),
        Alloc("w", (16, nc)),
        Alloc("z", (16, nc)),
        Loop(n, (Recv("ch", "y"), Compute("matmul", ("z",), ("y", "w")))),
    )
    return ProgramSet((Program(0, prod), Program(1, cons)), (Channel("ch", 0, (1,), depth),))


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_fifo_pipeline_consumer_bound(depth):
    # Tp = 32, S = 32 (512 B at 16 B/cycle), hop = 2, Tc = 128 > Tp + S.  First tile consumed at
    # c0 = Tp + S + hop; then one tile per Tc (the slower side), so the consumer ends at
    # c0 + n*Tc.  Back-pressure: once the FIFO is full the producer's i-th send waits for tile
    # i-depth to be consumed, so its last send starts at c0 + (n-1-depth)*Tc and ends S later.
    n, tp, tc, s, hop = 10, 32, 128, 32, 2
    r = simulate(_pipeline(n, depth, tp // 2, tc // 2), mesh_chip(1, 2))
    c0 = tp + s + hop
    assert r.cycles == c0 + n * tc
    prod, cons = r.stats.core(0), r.stats.core(1)
    assert prod.finish == c0 + (n - 1 - depth) * tc + s
    assert prod.busy == n * tp and prod.stall_send == prod.finish - n * tp
    assert cons.busy == n * tc and cons.stall_recv == c0
    assert r.stats.resource("link r0c0->r0c1 (E)").busy == n * s


def test_fifo_pipeline_producer_bound():
    # Tp + S = 160 > Tc = 32: one tile every Tp + S (the compute, then the send reading x);
    # the consumer ends Tc after the last arrival: n*(Tp + S) + hop + Tc.
    n, tp, tc, s, hop = 10, 128, 32, 32, 2
    r = simulate(_pipeline(n, 2, tp // 2, tc // 2), mesh_chip(1, 2))
    assert r.cycles == n * (tp + s) + hop + tc
    cons = r.stats.core(1)
    assert cons.busy == n * tc and cons.stall_recv == r.cycles - n * tc
    assert r.stats.core(0).stall_send == n * s


@pytest.mark.parametrize("k", [2, 3, 4])
def test_cannon_on_a_mesh(k):
    # Loads: every channel serves 2k blocks from cycle 0: T0 = L + 2k^2*512/(32k).  Step s+1 of
    # a core starts when its neighbours' step-s blocks arrive: Tc + S + hops*hop later.  Over the
    # k-1 shifts the longest chain uses both wrap-arounds (k-1 hops each) and single hops
    # otherwise: 3k-5 hops.  Then the last multiply, a barrier and the stores (L + k^2*512/(32k)).
    # Tc = max(2*16^3/256, 4*16*16*2/128) = 32, S = 512/16 = 32.
    r = simulate(cannon_programs(k), cannon_chip(k))
    assert r.cycles == cannon_cycles(k)
    assert cannon_cycles(4) == (100 + 128) + (4 * 32 + 3 * 32 + 2 * 7) + (100 + 64)
    for c in r.stats.cores:
        assert c.busy == 4 + k * 32  # zeros + k multiplies
