"""Reject a program set before it runs (DAM-style initialization checks, STYLE.md; Cyclotron §6:
every receive is matched by a send on another PE, determined statically).

``validate_programs(ps, chip)`` collects every problem and raises one :class:`ProgramError`
listing them, each naming the core, the instruction and what to change:

* declarations: duplicate names, core ids outside the chip, channels without destinations;
* channels: a send from a core that is not the channel's src, a receive by a core not among its
  dsts, a declared channel nobody uses, a destination that never receives, data/value mismatch,
  and static message counts that differ between the sender and a receiver;
* references to undeclared tensors, channels, barrier groups, unallocated buffers or undefined
  registers; unknown kernels; compute dtypes the chip's core has no FLOPs rate for;
* SRAM: the peak of live buffers (``Alloc``..``Free``) above ``chip.core.sram_bytes`` (a
  buffer allocated ``held`` at a bound counts what it holds, which the simulator checks);
* barriers: a member that never arrives, or static arrival counts that differ.
"""

from __future__ import annotations

from collections import Counter

from hwmodel.chip import Chip
from lowering.analysis import ProgramAnalysis, analyze_programs
from lowering.errors import ProgramError
from lowering.isa import DTYPE_BYTES, ProgramSet

__all__ = ["validate_programs", "program_problems"]


def _declaration_problems(ps: ProgramSet, chip: Chip) -> list[str]:
    problems: list[str] = []
    n = chip.num_cores
    valid = f"0..{n - 1} (chip {chip.name!r} has {n} cores)"
    for core, times in sorted(Counter(p.core for p in ps.programs).items()):
        if times > 1:
            problems.append(f"core {core} has {times} programs; give each core one program")
    for p in ps.programs:
        if not 0 <= p.core < n:
            problems.append(f"program for core {p.core}: core id must be in {valid}")
    for name, times in sorted(Counter(c.name for c in ps.channels).items()):
        if times > 1:
            problems.append(f"channel {name!r} is declared {times} times; declare it once")
    for ch in ps.channels:
        if not 0 <= ch.src < n:
            problems.append(f"channel {ch.name!r}: src core {ch.src} must be in {valid}")
        if not ch.dsts:
            problems.append(f"channel {ch.name!r} has no destination; give dsts")
        for d in ch.dsts:
            if not 0 <= d < n:
                problems.append(f"channel {ch.name!r}: dst core {d} must be in {valid}")
        if len(set(ch.dsts)) != len(ch.dsts):
            problems.append(f"channel {ch.name!r} lists a destination twice: {list(ch.dsts)}")
        if ch.src in ch.dsts:
            problems.append(
                f"channel {ch.name!r} sends from core {ch.src} to itself; keep the data in a "
                "buffer (or a copy kernel) instead"
            )
        if ch.depth is not None and ch.depth < 1:
            problems.append(
                f"channel {ch.name!r}: depth {ch.depth} must be >= 1 message (or None for the "
                "core's fifo_depth)"
            )
    for name, times in sorted(Counter(t.name for t in ps.tensors).items()):
        if times > 1:
            problems.append(f"tensor {name!r} is declared {times} times; declare it once")
    for t in ps.tensors:
        if t.dtype not in DTYPE_BYTES:
            problems.append(
                f"tensor {t.name!r}: unknown dtype {t.dtype!r}; use one of {sorted(DTYPE_BYTES)}"
            )
        if not t.shape or any(not isinstance(d, int) or d < 1 for d in t.shape):
            problems.append(f"tensor {t.name!r}: shape {list(t.shape)} must be positive integers")
    with_program = {p.core for p in ps.programs}
    for name, times in sorted(Counter(g for g, _ in ps.barriers).items()):
        if times > 1:
            problems.append(f"barrier group {name!r} is declared {times} times")
    for group, cores in ps.barriers:
        if not cores:
            problems.append(f"barrier group {group!r} has no cores")
        for c in cores:
            if not 0 <= c < n:
                problems.append(f"barrier group {group!r}: core {c} must be in {valid}")
            elif c not in with_program:
                problems.append(
                    f"barrier group {group!r} includes core {c}, which has no program and would "
                    "never arrive; remove it from the group or give it a program"
                )
    return problems


def _chip_problems(analysis: ProgramAnalysis, chip: Chip) -> list[str]:
    problems: list[str] = []
    rates = {name for name, _ in chip.core.flops_per_cycle}
    for core in analysis.cores:
        if core.peak_sram_bytes > chip.core.sram_bytes:
            bufs = ", ".join(f"{name} ({b} B)" for name, b in core.peak_buffers)
            problems.append(
                f"core {core.core} needs {core.peak_sram_bytes} bytes of SRAM at its peak "
                f"(live buffers: {bufs}) but chip {chip.name!r} has core.sram_bytes = "
                f"{chip.core.sram_bytes}; use smaller tiles, free buffers earlier, or spread the "
                "work over more cores"
            )
        for dtype in sorted(core.compute_dtypes - rates):
            problems.append(
                f"core {core.core} computes in {dtype} but chip {chip.name!r} has no "
                f"core.flops_per_cycle entry for it (has: {', '.join(sorted(rates))}); compute "
                "in one of those dtypes or add a rate to the chip"
            )
    return problems


def _channel_problems(ps: ProgramSet, analysis: ProgramAnalysis) -> list[str]:
    problems: list[str] = []
    by_core = {c.core: c for c in analysis.cores}
    for ch in ps.channels:
        src = by_core.get(ch.src)
        sends = {k: v for (name, k), v in src.sends.items() if name == ch.name} if src else {}
        recvs = {}
        for d in ch.dsts:
            dst = by_core.get(d)
            recvs[d] = (
                {k: v for (name, k), v in dst.recvs.items() if name == ch.name} if dst else {}
            )
        if not sends and not any(recvs.values()):
            problems.append(
                f"channel {ch.name!r} (core {ch.src} -> {list(ch.dsts)}) is declared but no "
                "program sends or receives on it; remove it or add the send and receives"
            )
            continue
        if not sends and all(n is None for got in recvs.values() for n in got.values()):
            continue  # every receive is decided at run time: a run may take none
        if not sends:
            problems.append(
                f"channel {ch.name!r}: core {ch.src} (its src) never sends on it, so its "
                "receivers would wait forever; add a send on core "
                f"{ch.src} or declare the channel from the core that sends"
            )
            continue
        for d, got in recvs.items():
            if not got:
                problems.append(
                    f"channel {ch.name!r}: destination core {d} never receives from it, so the "
                    f"sender would block once the FIFO fills; add a recv on core {d} or remove "
                    f"{d} from dsts"
                )
                continue
            for kind in sorted(set(sends) | set(got)):
                sent, received = sends.get(kind, 0), got.get(kind, 0)
                if sent is None or received is None or sent == received:
                    continue
                other = {"data": "send/recv", "value": "send_value/recv_value"}[kind]
                problems.append(
                    f"channel {ch.name!r}: core {ch.src} sends {sent} {kind} message(s) but core "
                    f"{d} receives {received}; every message needs exactly one receive by each "
                    f"destination ({other}) — fix the loop counts or the instructions"
                )
    return problems


def _barrier_problems(ps: ProgramSet, analysis: ProgramAnalysis) -> list[str]:
    problems: list[str] = []
    by_core = {c.core: c for c in analysis.cores}
    for group, cores in ps.barriers:
        arrivals = {c: by_core[c].barriers.get(group, 0) for c in cores if c in by_core}
        if all(v == 0 for v in arrivals.values()):
            problems.append(
                f"barrier group {group!r} is declared but no member executes `barrier {group}`; "
                "remove it or add the barriers"
            )
            continue
        known = {c: v for c, v in arrivals.items() if v is not None}
        for c, v in sorted(known.items()):
            if v == 0:
                problems.append(
                    f"barrier group {group!r}: core {c} never arrives, so the other members "
                    f"would wait forever; add `barrier {group}` to core {c} or remove it from "
                    "the group"
                )
        counts = sorted(set(known.values()) - {0})
        if len(counts) > 1:
            detail = ", ".join(f"core {c}: {v}" for c, v in sorted(known.items()))
            problems.append(
                f"barrier group {group!r}: members arrive different numbers of times "
                f"({detail}); every member must execute the barrier equally often"
            )
    return problems


def program_problems(ps: ProgramSet, chip: Chip) -> tuple[list[str], ProgramAnalysis]:
    """All problems of ``ps`` on ``chip`` (empty when valid) and the static analysis."""
    analysis = analyze_programs(ps)
    problems = _declaration_problems(ps, chip)
    problems += analysis.problems
    problems += _chip_problems(analysis, chip)
    problems += _channel_problems(ps, analysis)
    problems += _barrier_problems(ps, analysis)
    return problems, analysis


def validate_programs(ps: ProgramSet, chip: Chip) -> ProgramAnalysis:
    """Check ``ps`` against ``chip`` before running; return its :class:`ProgramAnalysis`
    (peak SRAM per core, static message counts) or raise :class:`ProgramError` listing every
    problem with what to change."""
    problems, analysis = program_problems(ps, chip)
    if problems:
        if len(problems) == 1:
            raise ProgramError(f"program set {ps.name!r}: {problems[0]}")
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ProgramError(f"program set {ps.name!r} has {len(problems)} problems:\n{listing}")
    return analysis
