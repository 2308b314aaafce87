"""Preload order permutation (ELK §4.4).

Only the HBM-heavy operators (HBM bytes above the average) are reordered, only within one layer,
and the same order is applied to every identical layer; light operators keep their positions.
A candidate order is *valid* when, at every heavy operator's preload, the operators that were
preloaded before it but execute after it, plus itself, fit on chip with their smallest
preload-state plans (ELK §4.4: "the preloaded operators cannot free their space until executed,
the on-chip memory will overflow").  Candidates are generated closest-first (by how far heavy
operators move) and each is scheduled by :func:`elk.schedule.schedule`; the identity order is
always a candidate, so reordering never worsens the plan.

The candidate orders are independent schedules, so a large plan schedules them on several
processes (:func:`plan_jobs`) and then picks the best exactly as one process would (first best
in candidate order): the same plan, in less wall time.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from elk.errors import ElkError
from elk.schedule import Item, Policy, Timeline, schedule

__all__ = [
    "heavy_slots",
    "candidate_orders",
    "valid_order",
    "best_order",
    "plan_jobs",
    "yielding",
]


#: At most this many HBM-heavy operators per layer are permuted (ELK §4.4: "H <= 6 in most
#: transformer models"); the heaviest are kept.
MAX_HEAVY = 6


def heavy_slots(items: Sequence[Item], limit: int = MAX_HEAVY) -> list[int]:
    """Slots of the first layer whose operators read more HBM bytes than the average (the
    ``limit`` heaviest, in execution order)."""
    if not items:
        return []
    mean = sum(it.hbm_bytes for it in items) / len(items)
    first = items[0].layer
    heavy = [it for it in items if it.layer == first and it.hbm_bytes > mean]
    heavy = sorted(heavy, key=lambda it: (-it.hbm_bytes, it.slot))[:limit]
    return sorted(it.slot for it in heavy)


def valid_order(items: Sequence[Item], order: Sequence[int], capacity: float) -> bool:
    """No preload in ``order`` forces more resident data than ``capacity`` (smallest plans)."""
    pos = {op: k for k, op in enumerate(order)}
    for j, it in enumerate(items):  # a routed operator is preloaded after what decides it
        if it.after >= 0 and any(pos[x] > pos[j] for x in range(it.after + 1)):
            return False
    low = [min(o.space for pre in it.preloads for o in pre) if it.preloads else 0 for it in items]
    exe = [min(o.space for o in it.execs) for it in items]
    seen_max = -1
    for k, op in enumerate(order):
        if op < seen_max:  # preloaded after a later operator: everything in between waits
            held = [j for j in order[: k + 1] if j >= op]
            if sum(low[j] for j in held if j != op) + max(low[op], exe[op]) > capacity:
                return False
        seen_max = max(seen_max, op)
    return True


def candidate_orders(
    items: Sequence[Item], capacity: float, max_orders: int = 16
) -> list[tuple[int, ...]]:
    """Valid preload orders permuting the heavy operators of a layer, identity first."""
    n = len(items)
    identity = tuple(range(n))
    heavy = heavy_slots(items)
    if len(heavy) < 2:
        return [identity]
    by_layer: dict[int, dict[int, int]] = {}
    for idx, it in enumerate(items):
        by_layer.setdefault(it.layer, {})[it.slot] = idx
    perms = sorted(
        itertools.permutations(range(len(heavy))),
        key=lambda p: (sum(abs(a - b) for a, b in enumerate(p)), p),
    )
    out: list[tuple[int, ...]] = []
    for perm in perms:
        order = list(identity)
        for slots in by_layer.values():
            if not all(h in slots for h in heavy):
                continue
            places = sorted(slots[h] for h in heavy)
            ops = [slots[heavy[p]] for p in perm]
            for place, op in zip(places, ops):
                order[place] = op
        cand = tuple(order)
        if cand not in out and valid_order(items, cand, capacity):
            out.append(cand)
        if len(out) >= max_orders:
            break
    return out


#: Plans of at least this many operators schedule their candidate orders in parallel (below,
#: forking costs more than it saves).
PARALLEL_OPS = 64


#: How much lower the scheduling priority of a plan's worker processes is inside
#: :func:`yielding` (``os.nice`` steps; 0 outside)
_NICE = 0

#: the ``os.nice`` increment :func:`yielding` gives a plan's worker processes
YIELD_NICE = 10


def plan_jobs() -> int:
    """Processes :func:`best_order` may use: ``TORCH2STEP_PLAN_JOBS`` if set, else the CPUs this
    process may run on."""
    env = os.environ.get("TORCH2STEP_PLAN_JOBS", "").strip()
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@contextmanager
def yielding() -> Iterator[None]:
    """Inside the block, a plan's worker processes run at a lower scheduling priority
    (:data:`YIELD_NICE`), so that work running beside the plan (a worker process simulating
    another step: :mod:`torch2step.kernel.stack`) keeps its CPU while the plan takes the CPU
    time left, every CPU once that work is done: whichever of the two takes longer, neither
    waits for the other's share of a CPU.  The plan is the same (:func:`best_order`)."""
    global _NICE
    old = _NICE
    _NICE = YIELD_NICE
    try:
        yield
    finally:
        _NICE = old


def _lower_priority(nice: int) -> None:
    """A plan's worker process starting (:func:`yielding`)."""
    os.nice(nice)


#: ``(items, policy, orders)`` of the running parallel :func:`best_order` (inherited by the
#: forked workers, so nothing large is pickled to them)
_JOB: tuple[Sequence[Item], Policy, list[tuple[int, ...]]] | None = None


def _scheduled(k: int) -> Timeline | None:
    """The schedule of candidate order ``k`` of :data:`_JOB` (``None``: it does not fit)."""
    assert _JOB is not None
    items, policy, orders = _JOB
    try:
        return schedule(items, policy, orders[k])
    except (ValueError, ElkError):
        return None


def _schedules(
    items: Sequence[Item], policy: Policy, orders: list[tuple[int, ...]], jobs: int
) -> list[Timeline | None]:
    """:func:`_scheduled` of every order, on ``jobs`` forked processes when that pays."""
    global _JOB
    jobs = min(jobs, len(orders))
    parallel = (
        jobs > 1
        and len(items) >= PARALLEL_OPS
        and "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon  # a pool's worker has no children
    )
    _JOB = (items, policy, orders)
    try:
        if not parallel:
            return [_scheduled(k) for k in range(len(orders))]
        init = (_lower_priority, (_NICE,)) if _NICE else (None, ())
        with multiprocessing.get_context("fork").Pool(jobs, *init) as pool:
            return pool.map(_scheduled, range(len(orders)), chunksize=1)
    finally:
        _JOB = None


def best_order(
    items: Sequence[Item], policy: Policy, max_orders: int = 16, jobs: int | None = None
) -> tuple[Timeline, int]:
    """The best schedule over the candidate orders and how many were tried; ``jobs``: processes
    to schedule them on (default :func:`plan_jobs`; the result does not depend on it)."""
    orders = candidate_orders(items, policy.capacity, max_orders)
    best: Timeline | None = None
    for t in _schedules(items, policy, orders, plan_jobs() if jobs is None else jobs):
        if t is None:
            continue
        if best is None or t.total < best.total - 1e-9:
            best = t
    assert best is not None  # the identity order is always tried
    return best, len(orders)
