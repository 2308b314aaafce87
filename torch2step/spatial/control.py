"""Control values a unit computes at run time from the data it receives.

A tile function whose result steers routing (a selector) has a *register lowering* here: the
unit reads the integer elements of its input tile into registers (``ReadValue``) and computes
the result with ``Calc`` / ``Set``, so the value it sends comes from the data of the run being
simulated, not from the run the program was built from (STeP (arXiv 2511.07776) §3.2.3:
Partition and Reassemble route by the selectors the graph computes).  Integer tiles carry their
values in timing mode too (loads of integer tensors and the messages forwarding them), so the
same program serves every routing — when no node of the graph stores an integer tensor
(:func:`control_data`; a layer whose router stores its top-k ids keeps the run's selectors,
except the control values an expert region computes from its merge's selector: those are
always computed in registers, :func:`lower_value`).

``REGISTER_FNS`` maps a function name to ``lower(b, f, elem, part) -> register | None``: it
emits the instructions after the unit step that computes the element and returns the register
holding the element's value (``None``: no lowering applies; the run's value is sent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowering.isa import Affine, Calc, ReadValue, Set
from torch2step.step.graph import Program
from torch2step.step.ops_memory import LinearOffChipStore, RandomOffChipStore

from .streams import Part
from .unit import Elem, UnitBuilder

__all__ = ["REGISTER_FNS", "control_data", "lower_value"]


def _to_selector(b: UnitBuilder, f: Any, elem: Elem, part: Part) -> str | None:
    """``to_selector``: the bitmask ``sum_j 1 << ids[j]`` of the ``[1, k]`` id tile (ids are
    distinct, so the sum is the k-hot mask the interpreter's selector has); a ``[1, 1]`` id
    that travels as a control value is shifted from its register."""
    if len(elem) != 1:
        return None
    ((src, buf),) = elem
    if buf is None:
        return None
    if src.kind == "value":  # a [1, 1] id received into a register
        b.emit(Calc("bit.0", "shl", 1, buf))
        return "bit.0"
    terms = []
    for j in range(src.elems):
        b.emit(ReadValue(f"id.{j}", buf, j), Calc(f"bit.{j}", "shl", 1, f"id.{j}"))
        terms.append((f"bit.{j}", 1))
    b.emit(Set("sel", Affine(0, tuple(terms))))
    return "sel"


#: Function name -> register lowering (module docstring).
REGISTER_FNS: dict[str, Callable[[UnitBuilder, Any, Elem, Part], str | None]] = {
    "to_selector": _to_selector,
}


#: Functions whose lowering reads an integer tile's elements from its buffer (``ReadValue``)
#: unless the ids arrive in a register; the others read received registers only.
TILE_READERS: frozenset[str] = frozenset({"to_selector"})


def control_data(graph: Program) -> bool:
    """Whether the integer tiles of ``graph``'s streams carry their values in every mode: no
    node stores an integer tensor (a router's top-k ids made by a compute unit exist only in
    the reference run: the simulator's unit steps are timed, not executed, so a unit reading
    them would read zeros in functional mode; their selectors stay the run's)."""
    for op in graph.nodes:
        if isinstance(op, (LinearOffChipStore, RandomOffChipStore)):
            if op.tensor.dtype in ("int32", "int64", "int8", "bool"):
                return False
    return True


def lower_value(
    b: UnitBuilder, f: Any, elem: Elem, out: Elem, enabled: bool = True, region: bool = False
) -> Elem:
    """``out`` (a unit step's result of function ``f`` on ``elem``) with its control value in
    the register the lowering of ``f`` computes, when ``f`` has one, ``out`` is one value and
    the graph's integer tiles carry values (``enabled``: :func:`control_data`).

    ``region``: the unit is a member of an expert region (STeP arXiv 2511.07776 §5.3,
    :mod:`.region_loop`), whose one program, built from the region's first chunk, serves every
    chunk: it lowers ``f`` of control values received into registers even when the integer
    tiles carry none (not of a tile read from its buffer, :data:`TILE_READERS`).  Those
    registers hold the selector the region's EagerMerge sends with each chunk (made by the merge
    unit itself, in the run's order or in the order it takes its inputs, :mod:`.merge_any`),
    what the region computes from it (expert index and id, weight addresses, padding index)
    and the padding flags of static tiles, not values a unit read from an integer tensor a
    compute unit stored.  The run's literal would be the first chunk's for every chunk: a
    lane's selector Map would send the first chunk's expert for every row, and the lane's
    Partition back to its experts would route all the lane's rows to that expert's output,
    more messages than its stream has (no FIFO depth fits: the Reassemble waits on the other
    experts' outputs, a deadlock)."""
    lower = REGISTER_FNS.get(f.name)
    if not enabled and not (
        region and (f.name not in TILE_READERS or all(p.kind == "value" and r for p, r in elem))
    ):
        lower = None
    if lower is None or len(out) != 1 or out[0][0].kind != "value":
        return out
    reg = lower(b, f, elem, out[0][0])
    return out if reg is None else ((out[0][0], reg),)
