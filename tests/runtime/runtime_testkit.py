"""Small chips and program builders shared by the simulator tests."""

from __future__ import annotations

from hwmodel.chip import AllToAllNoC, Chip, CoreSpec, HbmSpec, MeshNoC
from lowering.isa import (
    Alloc,
    Barrier,
    Channel,
    Compute,
    Free,
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

CORE = CoreSpec(
    flops_per_cycle=(("bf16", 256), ("fp32", 64)),
    sram_bytes=1 << 20,
    sram_bytes_per_cycle=128,
    fifo_depth=2,
)


def hbm(
    channels: int = 4,
    bw: float = 32.0,
    latency: int = 100,
    interleave: int = 64,
    attach: tuple[int, ...] = (),
) -> HbmSpec:
    """An HBM of ``channels`` x ``bw`` bytes/cycle."""
    return HbmSpec(channels, bw, latency, 1 << 34, interleave, attach)


def mesh_chip(
    rows: int,
    cols: int,
    *,
    link_bw: float = 16.0,
    hop: int = 2,
    core: CoreSpec = CORE,
    mem: HbmSpec | None = None,
) -> Chip:
    """A ``rows`` x ``cols`` mesh with uniform HBM unless ``mem`` says otherwise."""
    return Chip(
        name=f"mesh{rows}x{cols}",
        clock_ghz=1.0,
        num_cores=rows * cols,
        core=core,
        hbm=mem or hbm(),
        noc=MeshNoC(rows, cols, link_bw, hop),
    )


def a2a_chip(
    n: int, *, inj: float = 8.0, ej: float = 8.0, latency: int = 10, mem: HbmSpec | None = None
) -> Chip:
    """An all-to-all chip of ``n`` cores."""
    return Chip(
        name=f"a2a{n}",
        clock_ghz=1.0,
        num_cores=n,
        core=CORE,
        hbm=mem or hbm(),
        noc=AllToAllNoC(inj, ej, latency),
    )


def cannon_chip(k: int, *, hop: int = 2) -> Chip:
    """A k x k mesh for the blocked Cannon test: ``k`` HBM channels interleaved every 32 bytes,
    so with 16 x 16 bf16 blocks of a ``16k``-wide matrix, block column ``j`` lives in channel
    ``j`` and every channel carries the same share of the traffic."""
    return mesh_chip(
        k, k, link_bw=16.0, hop=hop, mem=hbm(channels=k, bw=32.0, latency=100, interleave=32)
    )


def cannon_programs(k: int, b: int = 16, dtype: str = "bf16") -> ProgramSet:
    """Output-stationary Cannon on a k x k mesh with a barrier after the loads and before the
    stores: core (i, j) loads A[i, (i+j)%k] and B[(i+j)%k, j], then k times multiplies and
    shifts A west / B north (rings; the wrap-around crosses the mesh), then stores C[i, j]."""
    n = k * b
    chans = []
    for i in range(k):
        for j in range(k):
            chans.append(Channel(f"a{i}_{j}", i * k + j, (i * k + (j - 1) % k,)))
            chans.append(Channel(f"b{i}_{j}", i * k + j, (((i - 1) % k) * k + j,)))
    progs = []
    for i in range(k):
        for j in range(k):
            s = (i + j) % k
            step = (
                Compute("matmul_acc", ("c",), ("a", "b", "c"), dtype=dtype),
                Send(f"a{i}_{j}", "a"),
                Send(f"b{i}_{j}", "b"),
                Recv(f"a{i}_{(j + 1) % k}", "a"),
                Recv(f"b{(i + 1) % k}_{j}", "b"),
            )
            body = (
                Alloc("a", (b, b), dtype),
                Alloc("b", (b, b), dtype),
                Alloc("c", (b, b), dtype),
                Load("a", "A", Region((i * b, s * b), (b, b))),
                Load("b", "B", Region((s * b, j * b), (b, b))),
                Compute("zeros", ("c",), (), (("shape", f"{b}x{b}"),), dtype),
                Barrier("all"),
                Loop(k - 1, step),
                Compute("matmul_acc", ("c",), ("a", "b", "c"), dtype=dtype),
                Barrier("all"),
                Store("c", "C", Region((i * b, j * b), (b, b))),
                Free("a"),
                Free("b"),
                Free("c"),
            )
            progs.append(Program(i * k + j, body))
    return ProgramSet(
        tuple(progs),
        tuple(chans),
        (
            TensorDecl("A", (n, n), dtype),
            TensorDecl("B", (n, n), dtype),
            TensorDecl("C", (n, n), dtype),
        ),
        (("all", tuple(range(k * k))),),
        name=f"cannon{k}x{k}",
    )


def cannon_cycles(k: int, b: int = 16, *, hop: int = 2) -> int:
    """Closed form of :func:`cannon_programs` on :func:`cannon_chip` (derivation in the test)."""
    blk = b * b * 2
    bw = 32 * k
    loads = 100 + 2 * k * k * blk // bw
    tc = max(2 * b**3 // 256, 4 * b * b * 2 // 128)
    s = blk // 16
    steps = k * tc + (k - 1) * s + hop * (3 * k - 5)
    stores = 100 + k * k * blk // bw
    return loads + steps + stores
