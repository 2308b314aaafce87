"""The suffixes the inductive schedule keeps (ELK §4.2): a suffix's state, what earlier steps
see of it (:func:`_vector`), the non-dominated set per ``(operator, P)`` (:func:`_keep`), and
lookups the scheduler repeats for every suffix, computed once (per preload order, per item)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import ge as _ge
from operator import itemgetter
from operator import sub as _sub

from elk.allocate import Option
from elk.model import Item, Policy, Step

__all__: list[str] = []  # used by elk.schedule and elk.contention


@dataclass(frozen=True, slots=True)
class _State:
    step: Step
    spre: tuple[float, ...]  # preload start, positions P .. N-1
    res: tuple[
        tuple[int, int, float, int, int], ...
    ]  # (op, space, end bound, preload plan, exec plan)
    parent: _State | None
    # ``res`` by operator (:func:`_resident`), worked out when a step after this one first asks
    resd: dict[int, tuple[int, float, int, int]] | None = field(
        default=None, compare=False, repr=False
    )


def _resident(st: _State) -> dict[int, tuple[int, float, int, int]]:
    """``st``'s resident table by operator: op -> (space, end bound, preload plan, exec plan)
    (kept on the suffix: every ``P`` of the step before it reads the same table)."""
    d = st.resd
    if d is None:
        d = {op: (sp, bound, q, e) for op, sp, bound, q, e in st.res}
        object.__setattr__(st, "resd", d)
    return d


_PMAX: dict[int, tuple[Sequence[int], list[int]]] = {}


def _last(order: Sequence[int], P: int) -> int:
    """The largest operator among the first ``P`` of the preload order (``-1``: none): the
    resident operators of a step lie below it (prefix maxima, kept per order)."""
    hit = _PMAX.get(id(order))
    if hit is None or hit[0] is not order:
        pm, m = [-1], -1
        for op in order:
            m = max(m, op)
            pm.append(m)
        if len(_PMAX) > 8:
            _PMAX.clear()
        hit = _PMAX[id(order)] = (order, pm)
    return hit[1][P]


def _vector(st: _State, items: Sequence[Item], pol: Policy) -> tuple[float, ...]:
    """What the operators before this step see of it (all larger is better): its start, the
    preload starts from its ``P`` on, its residents' end bounds and (negated) spaces, and
    (negated) the size of its core grid, which decides the preloads it waits behind
    (:func:`_lead`: a grid no larger in any dimension shares cores in no more cases)."""
    res = st.res
    it = items[st.step.op]
    grid: tuple[float, ...] = ()
    if it.ports and it.grids:
        r, c = it.grids[st.step.exec_plan]
        grid = (-float(r), -float(c)) if pol.mesh is not None else (-float(r * c),)
    own: tuple[float, ...] = ()
    if pol.plan_branch:  # its own preload as earlier steps schedule it (ELK §4.2)
        e = st.step.exec_plan
        own = (-it.load_time(e), -(it.ports[e] if it.ports else 0.0))
    return (
        st.step.start,
        *own,
        *st.spre,
        *(bound for _, _, bound, _, _ in res),
        *(-float(sp) for _, sp, _, _, _ in res),
        *grid,
    )


_EPS = 1e-12

# a kept suffix: its vector, the vector less ``_EPS`` (what dominates it is at least that
# throughout; worked out once per suffix, not per comparison), the suffix
_Kept = tuple[tuple[float, ...], tuple[float, ...], _State]


def _keep(kept: list[_Kept], vec: tuple[float, ...], st: _State, beam: int | None) -> list[_Kept]:
    """Add ``st`` to the non-dominated suffixes of one ``(operator, P)``; ``beam`` caps them
    (best start first).  The vectors grow with the later operators (their preload starts), so
    every pass over one runs in C (``map``), none in Python bytecode."""
    low = tuple(map(_sub, vec, repeat(_EPS)))
    for v, _, _ in kept:
        if all(map(_ge, v, low)):  # v >= vec - eps throughout: vec is dominated
            return kept
    out = [k for k in kept if not all(map(_ge, vec, k[1]))]
    out.append((vec, low, st))
    if beam is not None and len(out) > beam:
        out.sort(key=_first, reverse=True)
        out = out[:beam]
    return out


_first = itemgetter(0)

_PLAIN: dict[int, tuple[Item, tuple[Option, ...]]] = {}


def _plain(it: Item) -> tuple[Option, ...]:
    """``it``'s exec plans as allocation options (space, time, plan index), kept per item."""
    hit = _PLAIN.get(id(it))
    if hit is None or hit[0] is not it:
        if len(_PLAIN) > 65536:
            _PLAIN.clear()
        hit = _PLAIN[id(it)] = (
            it,
            tuple(Option(o.space, o.time, e) for e, o in enumerate(it.execs)),
        )
    return hit[1]


_BY_LOAD: dict[int, tuple[Item, tuple[int, ...]]] = {}


def _by_load(it: Item) -> tuple[int, ...]:
    """``it``'s exec plans by preload time (then the faster plan first), kept per item."""
    hit = _BY_LOAD.get(id(it))
    if hit is None or hit[0] is not it:
        if len(_BY_LOAD) > 65536:
            _BY_LOAD.clear()
        ranked = tuple(sorted(range(len(it.execs)), key=lambda e: (it.load_time(e), -e)))
        hit = _BY_LOAD[id(it)] = (it, ranked)
    return hit[1]
