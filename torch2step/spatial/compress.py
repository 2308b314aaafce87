"""Fold repeated iterations of a unit's instruction sequence into ``Loop`` s.

A unit program is produced as a list of *steps* (one per element it handles).  Consecutive
repetitions of a block of up to ``max_period`` steps become ``Loop(count, block)``; the pass
repeats on its own output, so nested stream structure (a reduction of ``L`` elements, ``B``
times) becomes nested loops, and rotating buffers (period 2 or more) still fold.  Blocks are
compared by value (instructions are frozen dataclasses).
"""

from __future__ import annotations

from collections.abc import Sequence

from lowering.isa import Instr, Loop

__all__ = ["compress"]

Block = tuple[Instr, ...]


def _fold_once(items: list[Block], max_period: int) -> list[Block]:
    table: dict[Block, int] = {}
    ids = [table.setdefault(b, len(table)) for b in items]
    n = len(items)
    out: list[Block] = []
    i = 0
    while i < n:
        best_count, best_period = 1, 1
        for p in range(1, max_period + 1):
            if i + 2 * p > n:
                break
            pattern = ids[i : i + p]
            c = 1
            while i + (c + 1) * p <= n and ids[i + c * p : i + (c + 1) * p] == pattern:
                c += 1
            if c >= 2 and c * p > best_count * best_period:
                best_count, best_period = c, p
        if best_count >= 2:
            body = tuple(x for b in items[i : i + best_period] for x in b)
            out.append((Loop(best_count, body),))
            i += best_count * best_period
        else:
            out.append(items[i])
            i += 1
    return out


def compress(steps: Sequence[Block], max_period: int = 8) -> tuple[Instr, ...]:
    """The instructions of ``steps`` with repetitions folded into (nested) loops."""
    items = [s for s in steps if s]
    while True:
        folded = _fold_once(items, max_period)
        if len(folded) == len(items):
            break
        items = folded
    return tuple(x for b in items for x in b)
