"""Which rank runs which core, and what the programs do with each HBM tensor.

Cores are spread over ranks in contiguous blocks of the sorted core ids (a rank runs many cores;
on a row-major PE grid a block is a band of rows, so most neighbour messages stay inside a
rank).  Tensors that some program stores to are *shared*: they live in one MPI window (the
chip's HBM, on the root rank); every other tensor is read-only and each rank holds a replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowering.isa import Load, LoadValue, ProgramSet, Store, walk

__all__ = ["RankPlan", "plan_ranks", "tensor_uses"]


@dataclass(frozen=True, slots=True)
class RankPlan:
    """``rank_of[core]`` for every core with a program; ``cores[r]``: rank ``r``'s cores."""

    size: int
    rank_of: dict[int, int]
    cores: tuple[tuple[int, ...], ...]


def plan_ranks(ps: ProgramSet, size: int) -> RankPlan:
    """Contiguous blocks of the sorted cores, as equal as possible, one per rank."""
    cores = sorted({p.core for p in ps.programs})
    blocks: list[tuple[int, ...]] = []
    start = 0
    for r in range(size):
        n = len(cores) // size + (1 if r < len(cores) % size else 0)
        blocks.append(tuple(cores[start : start + n]))
        start += n
    rank_of = {c: r for r, block in enumerate(blocks) for c in block}
    return RankPlan(size, rank_of, tuple(blocks))


def tensor_uses(ps: ProgramSet) -> tuple[set[str], set[str]]:
    """``(read, stored)``: tensors some program loads (``Load``/``LoadValue``) or stores."""
    read: set[str] = set()
    stored: set[str] = set()
    for prog in ps.programs:
        for ins in walk(prog.body):
            if isinstance(ins, (Load, LoadValue)):
                read.add(ins.tensor)
            elif isinstance(ins, Store):
                stored.add(ins.tensor)
    return read, stored
