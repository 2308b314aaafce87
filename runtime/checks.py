"""Checks and messages around compilation: a program set's declarations against the chip, and
how an instruction is named in an error.

:func:`check_declarations` checks that channels, barrier groups and programs name cores of the
chip, once each, before anything is compiled or run (DAM's ``InitializationError`` idea: every
channel used has both ends; STYLE.md); :func:`lowering.validate_programs` includes these checks,
so :func:`runtime.program.compile_programs` skips them for a validated set.  :func:`describe` is
the one line every simulator message (compile errors, run-time errors, deadlock reports) uses to
name an instruction.
"""

from __future__ import annotations

from hwmodel.chip import Chip
from lowering.isa import Instr, ProgramSet
from lowering.printer import format_instr
from runtime.errors import SimulationError
from runtime.state import fifo_depth

__all__ = ["check_declarations", "describe"]


def describe(ins: Instr | None) -> str:
    """One line for an instruction in a message (``None``: the end of a program)."""
    return "end of program" if ins is None else format_instr(ins)


def check_declarations(ps: ProgramSet, chip: Chip) -> None:
    """Channels, barrier groups and programs name cores of the chip, once each."""
    n = chip.num_cores
    where = f"program set {ps.name!r}"
    chans: set[str] = set()
    default = fifo_depth(None, chip)
    for ch in ps.channels:
        if ch.name in chans:
            raise SimulationError(f"{where}: channel {ch.name!r} is declared twice; rename one")
        chans.add(ch.name)
        dsts = ch.dsts
        if (
            len(dsts) == 1
            and 0 <= ch.src < n
            and 0 <= dsts[0] < n
            and (default if ch.depth is None else ch.depth) >= 1
        ):
            continue  # a well-formed unicast channel (most of them): the checks below pass
        cores = (ch.src, *ch.dsts)
        if any(not 0 <= c < n for c in cores):
            raise SimulationError(
                f"{where}: channel {ch.name!r} connects cores {cores} but chip {chip.name!r} has cores 0..{n - 1}"
            )
        if not ch.dsts or len(set(ch.dsts)) != len(ch.dsts):
            raise SimulationError(
                f"{where}: channel {ch.name!r} needs distinct destination cores, got {ch.dsts}"
            )
        depth = fifo_depth(ch.depth, chip)
        if depth < 1:
            raise SimulationError(
                f"{where}: channel {ch.name!r} has FIFO depth {depth}; use at least 1"
            )
    groups: set[str] = set()
    for name, members in ps.barriers:
        if name in groups:
            raise SimulationError(f"{where}: barrier group {name!r} is declared twice")
        groups.add(name)
        if not members or any(not 0 <= c < n for c in members) or len(set(members)) != len(members):
            raise SimulationError(
                f"{where}: barrier group {name!r} has members {members}; use distinct cores 0..{n - 1}"
            )
    seen: set[int] = set()
    for prog in ps.programs:
        if not 0 <= prog.core < n:
            raise SimulationError(
                f"{where}: a program is for core {prog.core} but chip {chip.name!r} has cores 0..{n - 1}"
            )
        if prog.core in seen:
            raise SimulationError(f"{where}: core {prog.core} has two programs; merge them")
        seen.add(prog.core)
    for name, members in ps.barriers:
        missing = [c for c in members if c not in seen]
        if missing:
            raise SimulationError(
                f"{where}: barrier group {name!r} includes cores {missing} that have no program; drop them from the group"
            )
