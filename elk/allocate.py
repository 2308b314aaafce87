"""Cost-aware on-chip memory allocation (ELK §4.3).

Each operator taking part in one scheduling step (the executing operator and the operators being
preloaded) offers a Pareto curve of plans, ``(space, time)`` pairs.  ELK starts from every
operator's fastest plan and, while the total space exceeds the capacity, moves the single
operator whose next smaller plan has the largest ``Δ = reduced space / increased time`` one step
down its curve ("ELK selects the most cost-effective operator ... stops when the total memory
requirement does not exceed the available capacity").  :func:`allocate_exhaustive` is the
brute-force optimum used to check the heuristic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Option", "Allocation", "pareto", "allocate", "allocate_exhaustive"]


@dataclass(frozen=True, slots=True)
class Option:
    """One plan of one operator: on-chip bytes it needs and cycles it costs; ``ref`` is the plan."""

    space: int
    time: float
    ref: object = None


@dataclass(frozen=True, slots=True)
class Allocation:
    """Chosen option index per group, their total space and total time."""

    choice: tuple[int, ...]
    space: int
    time: float


def pareto(options: Sequence[Option]) -> tuple[Option, ...]:
    """The Pareto-optimal options sorted by space ascending (so time strictly descending): each
    is faster than every option using the same or less space (ELK §4.3)."""
    best: list[Option] = []
    for o in sorted(options, key=lambda o: (o.space, o.time)):
        if not best or o.time < best[-1].time:
            best.append(o)
    return tuple(best)


def allocate(groups: Sequence[Sequence[Option]], capacity: int) -> Allocation | None:
    """ELK §4.3's Δ heuristic over Pareto curves ``groups`` (each sorted by space ascending, as
    :func:`pareto` returns); ``None`` when even the smallest plans do not fit."""
    if len(groups) <= 2:  # the scheduler's steps: the executing and at most the next operator
        quick = _fits_fastest(groups, capacity)
        if quick is not None:
            return quick
    return delta_heuristic(groups, capacity)


def delta_heuristic(groups: Sequence[Sequence[Option]], capacity: int) -> Allocation | None:
    """ELK §4.3's Δ loop alone (what :func:`allocate` runs when its shortcut does not apply):
    from every group's fastest plan, step the group with the largest reduced space per
    increased time to its next smaller plan until the plans fit ``capacity``."""
    if any(not g for g in groups):
        return None
    choice = [len(g) - 1 for g in groups]
    space = sum(g[c].space for g, c in zip(groups, choice))
    while space > capacity:
        best, best_delta = -1, -1.0
        for n, g in enumerate(groups):
            c = choice[n]
            if c == 0:
                continue
            saved = g[c].space - g[c - 1].space
            slower = g[c - 1].time - g[c].time
            delta = math.inf if slower <= 0 else saved / slower
            if delta > best_delta:
                best, best_delta = n, delta
        if best < 0:
            return None
        space -= groups[best][choice[best]].space - groups[best][choice[best] - 1].space
        choice[best] -= 1
    time = sum(g[c].time for g, c in zip(groups, choice))
    return Allocation(tuple(choice), space, time)


def _fits_fastest(groups: Sequence[Sequence[Option]], capacity: int) -> Allocation | None:
    """:func:`allocate`'s answer for one or two groups whose fastest plans fit together (the
    same sums in the same order); ``None``: not that case."""
    if len(groups) == 1:
        (g,) = groups
        if not g:
            return None
        o = g[-1]
        if o.space > capacity:
            return None
        return Allocation((len(g) - 1,), 0 + o.space, 0 + o.time)
    g, h = groups
    if not g or not h:
        return None
    a, b = g[-1], h[-1]
    space = 0 + a.space + b.space
    if space > capacity:
        return None
    return Allocation((len(g) - 1, len(h) - 1), space, 0 + a.time + b.time)


def allocate_exhaustive(groups: Sequence[Sequence[Option]], capacity: int) -> Allocation | None:
    """The fastest combination that fits, by trying all of them (for tests; exponential)."""
    best: Allocation | None = None
    for combo in itertools.product(*(range(len(g)) for g in groups)):
        space = sum(g[c].space for g, c in zip(groups, combo))
        if space > capacity:
            continue
        time = sum(g[c].time for g, c in zip(groups, combo))
        if best is None or time < best.time:
            best = Allocation(tuple(combo), space, time)
    return best
