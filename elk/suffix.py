"""The suffixes the inductive schedule keeps (ELK §4.2): a suffix's state, what earlier steps
see of it (:func:`_vector`), the non-dominated set per ``(operator, P)`` (:func:`_keep`), and
lookups the scheduler repeats for every suffix, computed once (per preload order, per item)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    # no NaN among ``spre`` (:func:`_clean`), worked out when first asked
    clean: bool | None = field(default=None, compare=False, repr=False)
    # the parts of :func:`_vector` before and after the preload starts, worked out when
    # first asked (:func:`_assemble` is asked several times per suffix)
    ends: tuple[tuple[float, ...], tuple[float, ...]] | None = field(
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
    return _assemble(st, items, pol, st.spre)


def _assemble(
    st: _State, items: Sequence[Item], pol: Policy, spre: tuple[float, ...]
) -> tuple[float, ...]:
    """:func:`_vector` with ``spre`` (all of the suffix's preload starts or a head of them);
    ``items`` and ``pol`` are those of the schedule that made ``st``."""
    ends = st.ends
    if ends is None:
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
        tail = (
            *(bound for _, _, bound, _, _ in res),
            *(-float(sp) for _, sp, _, _, _ in res),
            *grid,
        )
        ends = (st.step.start, *own), tail
        object.__setattr__(st, "ends", ends)
    return ends[0] + spre + ends[1]


#: A suffix's *anchor* is its ancestor this many steps later (:func:`_keyed`).
ANCHOR_DEPTH = 32


def _clean(st: _State) -> bool:
    """No NaN among ``st.spre`` (kept on the suffix and its ancestors: each state adds only the
    preload starts of its own head to its parent's)."""
    chain: list[_State] = []
    s: _State | None = st
    while s is not None and s.clean is None:
        chain.append(s)
        s = s.parent
    ok = True if s is None else bool(s.clean)
    for s in reversed(chain):
        if ok:
            m = len(s.spre) - (len(s.parent.spre) if s.parent is not None else 0)
            ok = all(x == x for x in s.spre[:m])
        object.__setattr__(s, "clean", ok)
    return ok


def _keyed(st: _State, items: Sequence[Item], pol: Policy) -> tuple[tuple[float, ...], object]:
    """:func:`_vector` less the preload starts the suffix shares with its anchor, and the
    anchor (``None``: the whole vector, no anchor).

    A suffix's ``spre`` is its head followed by its parent's ``spre``, so two suffixes with
    the same ancestor end with that ancestor's preload starts: on those positions both vectors
    hold the same values, which decide neither dominance (``x >= x - eps``; NaN excepted, so a
    tail holding one is not anchored) nor the order of the vectors.  Suffixes kept for one
    ``(operator, P)`` whose chains joined within :data:`ANCHOR_DEPTH` steps (most of them,
    however long the model) are then compared on their heads alone, not on the ``N - P``
    preload starts of every later operator (:func:`_keep`)."""
    a = st.parent
    for _ in range(ANCHOR_DEPTH - 1):
        if a is None:
            break
        a = a.parent
    if a is None or not _clean(a):
        return _vector(st, items, pol), None
    return _assemble(st, items, pol, st.spre[: len(st.spre) - len(a.spre)]), a


_EPS = 1e-12

# a kept suffix: its vector (:func:`_keyed`), the vector less ``_EPS`` (what dominates it is
# at least that throughout; worked out once per suffix, not per comparison), its anchor, the
# suffix
_Kept = tuple[tuple[float, ...], tuple[float, ...], object, _State]


def _keep(
    kept: list[_Kept],
    vec: tuple[float, ...],
    st: _State,
    beam: int | None,
    key: object = None,
    whole: Callable[[_State], tuple[float, ...]] | None = None,
) -> list[_Kept]:
    """Add ``st`` to the non-dominated suffixes of one ``(operator, P)``; ``beam`` caps them
    (the largest vectors first).  ``vec`` is the suffix's vector less its anchor's preload
    starts and ``key`` the anchor (:func:`_keyed`; ``None``: ``vec`` is the whole vector);
    two suffixes with the same anchor are compared on those vectors, any other two on their
    whole vectors (``whole``), which decides the same.  Every pass over a vector runs in C
    (``map``), none in Python bytecode."""
    low = tuple(map(_sub, vec, repeat(_EPS)))
    full: list[tuple[float, ...]] = []  # the whole vector and its low, when first needed

    def mine() -> list[tuple[float, ...]]:
        if not full:
            v = vec if key is None else whole(st)  # type: ignore[misc]
            full.extend((v, low if key is None else tuple(map(_sub, v, repeat(_EPS)))))
        return full

    for v, _, k, s in kept:
        if k is key:
            if all(map(_ge, v, low)):  # v >= vec - eps throughout: vec is dominated
                return kept
        elif all(map(_ge, v if k is None else whole(s), mine()[1])):  # type: ignore[misc]
            return kept
    out = []
    for e in kept:
        v, vlow, k, s = e
        if k is key:
            if all(map(_ge, vec, vlow)):
                continue
        elif all(map(_ge, mine()[0], vlow if k is None else _low(whole(s)))):  # type: ignore[misc]
            continue
        out.append(e)
    out.append((vec, low, key, st))
    if beam is not None and len(out) > beam:
        if all(e[2] is key for e in out):
            out.sort(key=_first, reverse=True)
        else:  # the whole vectors' order (equal tails do not change the order of two)
            out.sort(key=lambda e: e[0] if e[2] is None else whole(e[3]), reverse=True)  # type: ignore[misc]
        out = out[:beam]
    return out


def _low(v: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(map(_sub, v, repeat(_EPS)))


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
