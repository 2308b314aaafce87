"""The steady period of a simulated decode step: the layers not simulated, timed by the ones
that were.

A decode step of ``N`` identical layers is planned as one model (ELK §4.4: the same execute
plans, preload order and issue points in every layer), so once the first layer's cold start has
passed, each layer runs as the one before it, one period later — until the last layers, which
have no later layers' preloads to issue.  The per-core programs run every equal section of
layer 3 and later as a copy of layer 2's (:mod:`runtime.program_layers`,
:func:`lowering.elk_layers.find_layering`).  When a layer's first copy starts (on the first
core to reach it), the simulator records its state relative to that cycle
(:func:`runtime.backlog.backlog`): the links, ports and HBM channels, the event queue and the
transfers in flight, and every core's clock, wait, place in its program, registers, buffers'
pending accesses and unreceived messages.

:meth:`torch2step.kernel.stack.KernelStackProgram.report` simulates a ``k``-layer step planned
as a model of its own, so that its last layers end as the ``N``-layer step's do, and
:func:`steady_period` finds the first layers ``l, l + 1`` whose first copies started on the
same core and section with the same state (within :data:`GAP` cycles), ``P`` cycles apart.
The report then checks the plans (:func:`plans_differ`, :func:`layers_differ`): the ``k``-layer
plan decides layers ``1 .. l`` as the ``N``-layer plan does, the ``N``-layer plan decides each
of its layers ``l .. N - k + l`` as the layer before it, one layer on, and its last ``k - l``
layers as the ``k``-layer plan's.  Then the ``k`` layers' simulated cycles plus ``(N - k) * P``
are the whole step's.  The simulator is deterministic, and what a run does from a layer's start
on depends only on its state then and the programs still to run.  So:

* a simulation of all ``N`` layers reaches layer ``l``'s start in the shorter step's state
  (the same programs before it);
* it runs layers ``l .. N - k + l`` each from the state the one before started in, one period
  on (the same programs, one layer on);
* it then runs the last ``k - l`` layers from layer ``l + 1``'s state, as the shorter step
  does.

What is compared is not the state object by object: buffers, messages and pending accesses are
compared as each core's collections of them (their names differ from layer to layer), and the
resources' fractional clocks, equal to :data:`GAP` here, need not round alike in later layers.
On a mesh (Llama-3-8B, the first 6 layers of an 8-layer step) layers 3, 4 and 5 start in the
same recorded state, yet each layer's sections start ``P - 1`` or ``P`` cycles after the layer
before's: there the step is repeated to within a cycle per section, not exactly, and which of
the two (rounding or state the record misses) is not known.
So the report says which layers showed the period, and ``benchmarks/decode_stack.py
--sim-layers K --check`` prints it next to the cycles of simulating every layer.  Without the
recorded states (``marks``), :func:`steady_period` falls back on a regularity of the copies'
start cycles alone (``copy_starts``): three layers in a row, every section of each starting
``P`` cycles after the layer before's, every core's busy and stalled cycles repeating.

When the shorter step is planned otherwise (ELK-Dyn's first preloads depend on the step's
length, and so can a mesh's plan), the step's own plan's first ``k`` layers are simulated and
their period times the rest, their last layers standing for the step's: an estimate, as those
lack the later layers' preloads (0.5% to 1.3% over simulating every layer on Llama-3-8B, against
4% under for the plan's prediction).  When no period shows (too few layers simulated, or no two
layers start in the same state) the rest is the plan's prediction.  The report
says which of these it did, and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elk.plan import ElkSchedule
from runtime.backlog import backlog_gap

__all__ = ["Steady", "steady_period", "plans_differ", "layers_differ", "MIN_LAYERS"]

#: the fewest simulated layers that can show a period: the cold first layer, the second (whose
#: sections the later layers copy, so no state is recorded at its start), two steady ones, and
#: the last, whose missing preloads change its timing
MIN_LAYERS = 5

#: the layer whose sections later layers copy: a copy of layer ``l``'s section is shifted by
#: ``(l - COPIED) * per_layer`` operators (:func:`lowering.elk_layers.find_layering`)
COPIED = 2


@dataclass(frozen=True)
class Steady:
    """The outcome: ``period`` cycles per layer (``None``: no period shown) seen across the
    layers ``first .. last`` (1-based), or ``why`` not; ``cut``: why the layers simulated are
    the step's own plan's first ones, not a shorter step planned on its own (``""``: they are
    the shorter step's)."""

    period: int | None
    first: int = 0
    last: int = 0
    why: str = ""
    cut: str = ""
    #: the largest difference, in cycles, between the shared resources' backlogs at the
    #: starts of those layers (:func:`runtime.backlog.backlog`; ``None``: not compared)
    gap: float | None = None

    def __str__(self) -> str:
        if self.period is None:
            return f"no steady period: {self.cut + ', and ' if self.cut else ''}{self.why}"
        if self.gap is None:
            return (
                f"steady period {self.period} cycles per layer (layers {self.first}-{self.last}: "
                "every core started every section of a layer exactly that much after the layer "
                "before, its cycles busy and stalled alike)"
            )
        return (
            f"steady period {self.period} cycles per layer (layers {self.first} and "
            f"{self.last} started that far apart with the simulator in the same state: the "
            "links, ports, HBM channels, event queue and transfers in flight, every core's "
            "clock, place in its program, registers, buffers and unreceived messages; to "
            f"{self.gap:.1g} cycles)"
        )


#: backlogs at the starts of the layers of a period may differ by this many cycles (rounding of
#: the resources' fractional clocks; a cycle's work is 1)
GAP = 1e-6


def steady_period(
    starts: Iterable[tuple], per_layer: int, layers: int, marks: Mapping[int, tuple] | None = None
) -> Steady:
    """The steady period of a ``layers``-layer run whose copies started at ``starts``
    (:attr:`runtime.stats.SimResult.copy_starts`; a copy of layer ``l``'s section has shift
    ``(l - COPIED) * per_layer``, the operators of one layer), see the module docstring.

    With ``marks`` (:attr:`runtime.stats.SimResult.copy_marks`, what a report passes): the
    first two consecutive layers whose first copies started on the same core and section with
    the same simulator state (:func:`runtime.backlog.backlog`, within :data:`GAP` cycles); the
    period is the cycles between those starts.  Without: two consecutive steady pairs with the
    same period in which, besides, every core spent the same cycles busy and the same stalled
    between its starts of a section in both pairs (a regularity of the starts alone)."""
    at: dict[int, dict[tuple[int, int], tuple]] = {}
    for core, tmpl, shift, cycle, cats in starts:
        if shift <= 0 or shift % per_layer:
            return Steady(None, why=f"a copy shifted by {shift}, not whole layers of {per_layer}")
        # busy and stalled cycles: which wait a stalled cycle is charged to (receive, send,
        # memory, barrier) can alternate where two complete in the same cycle
        at.setdefault(shift // per_layer + COPIED, {})[(core, tmpl)] = (
            cycle,
            cats[0],
            sum(cats[1:]),
        )
    if layers < MIN_LAYERS:
        return Steady(None, why=f"{layers} layers simulated, at least {MIN_LAYERS} are needed")
    if not at:
        return Steady(None, why=f"no layer ran as a copy of layer {COPIED} (its sections differ)")
    if marks is not None:
        return _same_state(marks, per_layer, layers)
    # per layer pair (l, l + 1): its period (None: none) and every start's change
    pairs: dict[int, tuple[int | None, dict]] = {}
    for layer in range(2, layers):
        a, b = at.get(layer), at.get(layer + 1)
        if not a or not b or a.keys() != b.keys():
            pairs[layer] = (None, {})
            continue
        moved = {k: tuple(y - x for x, y in zip(a[k], b[k])) for k in a}
        seen = {d[0] for d in moved.values()}
        pairs[layer] = (seen.pop() if len(seen) == 1 else None, moved)
    for layer in range(2, layers - 1):
        (p, m1), (q, m2) = pairs[layer], pairs[layer + 1]
        if p is not None and p > 0 and p == q and m1 == m2:
            return Steady(p, layer, layer + 2)
    return Steady(
        None,
        why="no three layers in a row started each section one equal period apart; simulate "
        "more layers, or read the plan's prediction",
    )


def _same_state(marks: Mapping[int, tuple], per_layer: int, layers: int) -> Steady:
    """:func:`steady_period` with marks: the first layers ``l, l + 1`` whose first copies
    started on the same core and section with the same state."""
    held = ""
    for layer in range(COPIED + 1, layers):
        a = marks.get((layer - COPIED) * per_layer)
        b = marks.get((layer + 1 - COPIED) * per_layer)
        if a is None or b is None or a[:2] != b[:2] or b[2] <= a[2]:
            continue
        gap = backlog_gap(a[3], b[3])
        if gap is not None and gap <= GAP:
            return Steady(b[2] - a[2], layer, layer + 1, gap=gap)
        held = held or (
            f"layers {layer} and {layer + 1} started on the same core, but the shared "
            "resources, the transfers in flight or the cores (their places, buffers or "
            "unreceived messages) held other work at their starts"
        )
    return Steady(
        None,
        why=(held or "no two layers in a row started their first copy on the same core")
        + "; simulate more layers, or read the plan's prediction",
    )


def plans_differ(full: ElkSchedule, short: ElkSchedule, ops: int) -> str:
    """Where the plan ``short`` of the first layers of the step planned as ``full`` decides its
    first ``ops`` operators differently (``""``: nowhere): their execute-state plans, the
    preload-state plans, the preloads issued before each (ELK §4.2's preload numbers) and the
    preload order up to there — what their per-core programs are built from."""
    fs, ss = full.timeline.steps, short.timeline.steps
    fp, sp = full.plans, short.plans
    top = 0
    for i in range(ops):
        a, b = fs[i], ss[i]
        if a.exec_plan != b.exec_plan or fp[i] != sp[i]:
            return f"operator {i} ({full.ops[i].name}) has another execute-state plan"
        if a.P != b.P or a.next_preload != b.next_preload:
            return f"operator {i} ({full.ops[i].name}) issues other preloads"
        top = max(top, a.P)
    if full.timeline.order[:top] != short.timeline.order[:top]:
        return "the preload order differs"
    fpp, spp = full.timeline.preload_plan, short.timeline.preload_plan
    for o in full.timeline.order[:top]:
        if (fpp[o] if o < len(fpp) else None) != (spp[o] if o < len(spp) else None):
            return f"operator {o} ({full.ops[o].name}) has another preload-state plan"
    return ""


def _sections(s: ElkSchedule) -> list[tuple]:
    """Per operator ``i``, what its section of the per-core programs is built from, relative
    to ``i`` (:func:`lowering.elk_programs`: ELK §4.5): whether it is the last, its execute-state
    plan, and the preloads issued in it — each preloaded operator's offset from ``i``, its
    execute plan and its preload-state plan (ELK §4.2-§4.4)."""
    tl = s.timeline
    steps, order, pp, plans = tl.steps, tl.order, tl.preload_plan, s.plans
    n = len(steps)
    out = []
    first = 0
    for i, t in enumerate(steps):
        pre = tuple(
            (order[k] - i, plans[order[k]], pp[order[k]] if order[k] < len(pp) else None)
            for k in range(first, t.P)
        )
        out.append((i == n - 1, t.exec_plan, plans[i], pre))
        first = max(first, t.P)
    return out


def layers_differ(
    full: ElkSchedule, short: ElkSchedule, per_layer: int, first: int, last: int
) -> str:
    """Where the step planned as ``full`` (``N`` layers) is not the one ``short`` (``k``
    layers, in the same state at the starts of layers ``first`` and ``last = first + 1``)
    stands for, beyond :func:`plans_differ`'s first layers (``""``: nowhere): the ``N``-layer
    plan decides each of its layers ``first + 1 .. N - k + first`` as the layer before it, one
    layer on, and its layers from ``N - k + last`` as the ``k``-layer plan's from ``last``."""
    fs, ss = _sections(full), _sections(short)
    n, k = len(fs) // per_layer, len(ss) // per_layer
    for i in range((first - 1) * per_layer, (n - k + first - 1) * per_layer):
        if fs[i] != fs[i + per_layer]:
            j = i + per_layer
            return (
                f"the {n}-layer plan decides operator {j} ({full.ops[j].name}) of layer "
                f"{j // per_layer + 1} otherwise than the layer before"
            )
    shift = (n - k) * per_layer
    for i in range((last - 1) * per_layer, k * per_layer):
        if ss[i] != fs[i + shift]:
            return (
                f"the {n}-layer plan decides operator {i + shift} ({full.ops[i + shift].name}) "
                f"otherwise than the {k}-layer plan its layer {i // per_layer + 1}"
            )
    return ""
