"""Simulator speed: simulated events per second of wall time, on one CPU core.

    python benchmarks/sim_speed.py                  # all three measurements
    python benchmarks/sim_speed.py --cores 368      # a smaller exchange (quick check)
    python benchmarks/sim_speed.py --profile exchange
    python benchmarks/sim_speed.py --only stream    # one of the three
    python benchmarks/sim_speed.py --bytecodes --cores 128 --stream-kib 128
                                                    # Python bytecodes per event (deterministic)

(i)   an all-to-all personalised exchange on the 1472-core ``ipu-hbm`` preset: in step s every
      core sends one message to core i+s and receives one from core i-s (1472 x 1471 messages,
      received into 16 rotating buffers);
(ii)  Cannon's matmul (``lowering.cannon_matmul``) on a 16 x 16 mesh of ``mesh`` preset cores;
(iii) a bandwidth-bound HBM stream (every ipu-hbm core streams its share of a tensor) against
      its closed-form roofline ``hbm latency + exchange latency + bytes / HBM bandwidth``.

An event is what :mod:`runtime.engine` says, counted once when the engine processes it: an
operation a core's sequencer executes, a grant the engine computes for a resource (a link, a
port, or a class of HBM channels served together), or a payload delivered.  Work done in closed
form is printed apart and is not in the events/s figure: instructions fast-forwarded and the
per-channel HBM grants a class grant stands for ("HBM channel grants served in closed form").
The set-up (building programs, validating and compiling them) is timed separately from the run;
the run is timed in wall seconds and in CPU seconds of this process (the same on an idle
machine; on a shared one the CPU figure is the simulator's own cost).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hwmodel.chip import AllToAllNoC, Chip, CoreSpec, HbmSpec  # noqa: E402
from lowering import cannon_matmul  # noqa: E402
from lowering.isa import (  # noqa: E402
    Affine,
    Alloc,
    Channel,
    Load,
    Loop,
    Program,
    ProgramSet,
    Recv,
    Region,
    Send,
    TensorDecl,
)
from runtime import SimResult, Simulator  # noqa: E402


def ipu_chip() -> tuple[Chip, str]:
    """The ``ipu-hbm`` preset, or an equivalent chip when the preset is not available."""
    try:
        from hwmodel import load_chip

        return load_chip("ipu-hbm"), "preset ipu-hbm"
    except (ImportError, AttributeError):
        core = CoreSpec((("bf16", 128), ("fp16", 128), ("fp32", 32)), 638976, 16)
        chip = Chip(
            "ipu-hbm-equivalent",
            1.33,
            1472,
            core,
            HbmSpec(64, 47.0, 133, 96 << 30, 256),
            AllToAllNoC(4.135, 4.135, 20),
        )
        return chip, "constructed 1472-core all-to-all chip (no ipu-hbm preset found)"


def mesh16() -> Chip:
    """A 16 x 16 mesh of ``mesh`` preset cores (links, HBM ports on the west/east edges)."""
    from hwmodel import load_chip, with_mesh_shape

    return with_mesh_shape(load_chip("mesh"), 16, 16)


def exchange_programs(n: int, nbytes: int = 64, rx: int = 16) -> ProgramSet:
    """All-to-all personalised exchange among cores 0..n-1 (receives rotate over ``rx``
    buffers, so a receive waits only for the one ``rx`` steps earlier)."""
    elems = nbytes // 2
    chans = tuple(Channel(f"x{i}_{d}", i, (d,)) for i in range(n) for d in range(n) if d != i)
    allocs = (Alloc("m", (elems,)),) + tuple(Alloc(f"r{j}", (elems,)) for j in range(rx))
    progs = []
    for i in range(n):
        sends = tuple(Send(f"x{i}_{(i + s) % n}", "m") for s in range(1, n))
        recvs = tuple(Recv(f"x{(i - s) % n}_{i}", f"r{s % rx}") for s in range(1, n))
        progs.append(Program(i, allocs + sends + recvs))
    return ProgramSet(tuple(progs), chans, name=f"exchange{n}")


def stream_programs(chip: Chip, per_core: int, tile: int) -> ProgramSet:
    """Every core streams ``per_core`` bytes of one tensor in ``tile``-byte loads; in step ``i``
    core ``c`` reads tile ``i * cores + c``, so each step's requests cover all HBM channels."""
    n = chip.num_cores
    te = tile // 2
    tiles = per_core // tile
    progs = tuple(
        Program(
            c,
            (
                Alloc("t", (te,)),
                Loop(
                    tiles,
                    (Load("t", "w", Region((Affine(c * te, (("i", n * te),)),), (te,))),),
                    var="i",
                ),
            ),
        )
        for c in range(n)
    )
    return ProgramSet(progs, tensors=(TensorDecl("w", (n * tiles * te,)),), name="stream")


#: ``--bytecodes``: count the Python bytecodes each run executes instead of timing it
COUNT_BYTECODES = False


def run_counting_bytecodes(sim: Simulator) -> tuple[SimResult, int]:
    """``sim.run()`` under an opcode tracer: the result and the bytecodes the run executed
    (a measure of the simulator's work per event that a shared machine does not disturb;
    builtins count as the one instruction that calls them)."""
    count = 0

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202 - sys.settrace's protocol
        nonlocal count
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        res = sim.run()
    finally:
        sys.settrace(None)
    return res, count


def measure(label: str, build, chip: Chip, repeat: int = 1) -> SimResult:
    """Build the programs, then ``repeat`` times: set up a simulator and time its run (with
    ``--bytecodes``: once, counting its bytecodes)."""
    t0 = time.perf_counter()
    ps = build()
    t1 = time.perf_counter()
    if COUNT_BYTECODES:
        res, count = run_counting_bytecodes(Simulator(ps, chip))
        e = res.stats.events
        print(f"{label}")
        print(
            f"  simulated {res.cycles} cycles; {e.events} events, {count} Python bytecodes: "
            f"{count / e.events:.1f} bytecodes per event"
        )
        return res
    setup_s = run_s = cpu_s = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        sim = Simulator(ps, chip)
        t2 = time.perf_counter()
        c2 = time.process_time()
        res = sim.run()
        cpu_s += time.process_time() - c2
        run_s += time.perf_counter() - t2
        setup_s += t2 - t
    e = res.stats.events
    print(f"{label}")
    print(
        f"  simulated {res.cycles} cycles; build {t1 - t0:.2f} s, validate+compile "
        f"{setup_s / repeat:.2f} s, run {run_s / repeat:.3f} s ({cpu_s / repeat:.3f} s CPU)"
    )
    print(
        f"  events {e.events} ({e.stepped} sequencer operations, {e.reservations} resource "
        f"grants, {e.deliveries} deliveries; {e.queue_pops} queue pops)"
    )
    print(
        f"  closed form (not events): {e.fast_forwarded} instructions fast-forwarded, "
        f"{e.closed_form_grants} HBM channel grants served in closed form"
    )
    print(
        f"  => {e.events * repeat / run_s:,.0f} events/s ({e.events * repeat / cpu_s:,.0f} per "
        f"CPU second), {e.instructions * repeat / run_s:,.0f} instructions/s, "
        f"{e.queue_pops * repeat / run_s:,.0f} queue pops/s"
    )
    return res


def stream_roofline(chip: Chip, per_core: int = 1 << 19, tile: int = 4096) -> None:
    """(iii): every core streams ``per_core`` bytes (default 512 KiB); HBM (3008 B/cycle on
    ``ipu-hbm``) is the bound, the cores' ejection ports together could take twice that."""
    res = measure(
        f"(iii) HBM stream, {chip.num_cores} cores x {per_core >> 10} KiB in {tile >> 10} KiB loads",
        lambda: stream_programs(chip, per_core, tile),
        chip,
    )
    if COUNT_BYTECODES:
        return
    hbm = chip.hbm
    lat = hbm.latency_cycles + (chip.noc.latency_cycles if isinstance(chip.noc, AllToAllNoC) else 0)
    total = chip.num_cores * per_core
    roofline = lat + total / hbm.bytes_per_cycle
    print(
        f"  roofline = latency {lat} + {total} B / {hbm.bytes_per_cycle:g} B/cycle = "
        f"{roofline:.0f} cycles; simulated {res.cycles} cycles"
    )
    print(f"  simulated / roofline = {res.cycles / roofline:.2f} ({res.cycles / roofline:.4f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cores", type=int, default=None, help="exchange among this many cores")
    ap.add_argument("--profile", choices=["exchange", "cannon", "stream"], default=None)
    ap.add_argument(
        "--only", choices=["exchange", "cannon", "stream"], default=None, help="run one case"
    )
    ap.add_argument(
        "--stream-kib", type=int, default=512, help="KiB each core streams in (iii) (default 512)"
    )
    ap.add_argument(
        "--bytecodes",
        action="store_true",
        help="count Python bytecodes per event instead of timing (slow: use --cores 128 and "
        "--stream-kib 128)",
    )
    args = ap.parse_args()
    global COUNT_BYTECODES
    COUNT_BYTECODES = args.bytecodes

    chip, origin = ipu_chip()
    mesh = mesh16()
    n = args.cores or chip.num_cores
    print(f"chip for (i) and (iii): {origin}; for (ii): {mesh.name} cut to 16x16")
    cases = {
        "cannon": lambda: measure(
            "(ii) Cannon 1024x1024x1024 fp32 on a 16x16 mesh (mesh preset cores), 5 runs",
            lambda: cannon_matmul(mesh, 1024, 1024, 1024, grid=(16, 16)),
            mesh,
            repeat=5,
        ),
        "exchange": lambda: measure(
            f"(i) all-to-all exchange, {n} cores x {n - 1} messages of 64 B",
            lambda: exchange_programs(n),
            chip,
        ),
        "stream": lambda: stream_roofline(chip, args.stream_kib << 10),
    }
    if args.profile:
        cProfile.runctx("cases[args.profile]()", globals(), locals(), "/tmp/sim_speed.prof")
        pstats.Stats("/tmp/sim_speed.prof").sort_stats("tottime").print_stats(25)
        return
    for name, run in cases.items():
        if args.only in (None, name):
            run()
            gc.collect()  # free the previous case outside the timed runs


if __name__ == "__main__":
    main()
