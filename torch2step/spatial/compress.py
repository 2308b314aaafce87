"""Fold repeated iterations of a unit's instruction sequence into ``Loop`` s.

A unit program is produced as a list of *steps* (one per element it handles).  Consecutive
repetitions of a block of up to ``max_period`` steps become ``Loop(count, block)``; the pass
repeats on its own output, so nested stream structure (a reduction of ``L`` elements, ``B``
times) becomes nested loops, and rotating buffers (period ``d`` for ``d`` buffers: a DMA unit
keeps up to 16 tiles in flight) still fold.  Blocks are compared by value (instructions are
frozen dataclasses), through one integer id per distinct block.

Each pass folds the repetitions of the shortest period that repeats anywhere, so inner loops
form before outer ones (a reduction's repeated middle steps, then the reductions).  Only periods
at which the block at ``i`` recurs are tried (the distances to the next occurrences of the same
id, from a next-occurrence array), so a pass costs about one comparison of blocks per step.

An instruction's id is found once per instruction object (:class:`_Interner`): instructions are
hashed by value only on first sight (by their class and the tuple of their fields' values), and a ``Loop`` a pass folds is identified by its count and
its body's ids, so later passes never rehash the instructions nested in it (hashing a frozen
dataclass recurses through everything it holds).  A block's ids are likewise found once per
block object, so a pass costs one lookup per block it keeps from the previous pass.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

from lowering.isa import Instr, Loop

__all__ = ["compress", "MAX_PERIOD"]

#: Longest block folded (in steps): covers the 16 rotating buffers of a DMA unit with room.
MAX_PERIOD = 64

Block = tuple[Instr, ...]


def _repeats(ids: list[int], i: int, p: int, n: int) -> int:
    """How many times the block ``ids[i : i + p]`` repeats back to back from ``i``."""
    pattern = ids[i : i + p]
    c = 1
    j = i + p
    while j + p <= n and ids[j : j + p] == pattern:
        c += 1
        j += p
    return c


class _Interner:
    """One integer per distinct instruction value (equal instructions, equal ids), found once
    per instruction object: a ``Loop`` by its count, variable and its body's ids, any other
    instruction by its value.  The objects seen are kept, so their ``id`` stays theirs."""

    def __init__(self) -> None:
        self.by_obj: dict[int, int] = {}
        self.by_key: dict[object, int] = {}
        self.keep: list[Instr] = []
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.keep_blocks: list[Block] = []

    def block(self, b: Block) -> tuple[int, ...]:
        """The ids of the instructions of block ``b``, found once per block object (a pass
        keeps most blocks of the previous one, so later passes look each up once)."""
        key = self.blocks.get(id(b))
        if key is None:
            by_obj, by_key, keep, fields = self.by_obj, self.by_key, self.keep, _FIELDS
            out = []
            for x in b:  # __call__, inlined: a unit's steps hold hundreds of thousands
                i = by_obj.get(id(x))
                if i is None:
                    cls = type(x)
                    if cls is Loop:
                        i = self(x)
                    else:
                        get = fields.get(cls)
                        if get is None:
                            get = fields[cls] = _fields_of(cls)
                        i = by_key.setdefault((cls, get(x)), len(by_key))
                        by_obj[id(x)] = i
                        keep.append(x)
                out.append(i)
            key = self.blocks[id(b)] = tuple(out)
            self.keep_blocks.append(b)
        return key

    def __call__(self, x: Instr) -> int:
        i = self.by_obj.get(id(x))
        if i is None:
            cls = type(x)
            if cls is Loop:
                key: object = ("loop", x.count, x.var, tuple(map(self, x.body)))
            else:
                fields = _FIELDS.get(cls)
                if fields is None:
                    fields = _FIELDS[cls] = _fields_of(cls)
                key = (cls, fields(x))
            i = self.by_key.setdefault(key, len(self.by_key))
            self.by_obj[id(x)] = i
            self.keep.append(x)
        return i


#: instruction class -> a getter of its fields' values as a tuple (:func:`_fields_of`)
_FIELDS: dict[type, Callable[[Any], tuple]] = {}


def _fields_of(cls: type) -> Callable[[Any], tuple]:
    """The values of the fields of dataclass ``cls`` in order, as one tuple: with the class,
    the key an instruction is interned by.  Two instructions are equal exactly when their
    classes and these tuples are (the dataclass's own ``__eq__``), and the tuple is hashed
    without the generated Python ``__hash__`` of the instruction itself."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda x: (one(x),)
    return operator.attrgetter(*names)


def _ids(items: list[Block], intern: _Interner) -> tuple[list[int], list[int]]:
    """One id per distinct block, and for every position the next position with the same id
    (``len(items)`` when none)."""
    table: dict[tuple[int, ...], int] = {}
    block = intern.block
    ids = [table.setdefault(block(b), len(table)) for b in items]
    n = len(ids)
    nxt = [n] * n
    last: dict[int, int] = {}
    for j in range(n - 1, -1, -1):
        nxt[j] = last.get(ids[j], n)
        last[ids[j]] = j
    return ids, nxt


def _shortest_period(ids: list[int], nxt: list[int], i: int, max_period: int) -> int:
    """The shortest period ``p`` whose block at ``i`` repeats at once (0: none)."""
    n = len(ids)
    j = nxt[i]
    while j < n and j - i <= max_period:
        p = j - i
        if i + 2 * p > n:
            return 0
        if ids[j : j + p] == ids[i : i + p]:
            return p
        j = nxt[j]
    return 0


def _fold_once(items: list[Block], max_period: int, intern: _Interner) -> list[Block]:
    """Fold every repetition of the shortest period that repeats anywhere (innermost loops
    first, so nested stream structure becomes nested loops)."""
    ids, nxt = _ids(items, intern)
    n = len(items)
    periods = [_shortest_period(ids, nxt, i, max_period) for i in range(n)]
    found = [p for p in periods if p]
    if not found:
        return items
    want = min(found)
    out: list[Block] = []
    i = 0
    while i < n:
        if periods[i] == want:
            c = _repeats(ids, i, want, n)
            body = tuple(x for b in items[i : i + want] for x in b)
            out.append((Loop(c, body),))
            i += c * want
        else:
            out.append(items[i])
            i += 1
    return out


def compress(steps: Sequence[Block], max_period: int = MAX_PERIOD) -> tuple[Instr, ...]:
    """The instructions of ``steps`` with repetitions folded into (nested) loops."""
    items = [s for s in steps if s]
    intern = _Interner()
    while True:
        folded = _fold_once(items, max_period, intern)
        if len(folded) == len(items):
            break
        items = folded
    return tuple(x for b in items for x in b)
