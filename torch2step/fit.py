"""When a layer does not fit the chip: the options that need fewer cores, and fewer expert lanes
than the default chosen — and said — when the default does not fit.

A MoE layer's experts run in ``R`` expert regions ("lanes", STeP arXiv 2511.07776 §5.3), each
time-multiplexing ``E/R`` experts; fewer lanes need fewer units and cores.  When the user does
not say (``moe_lanes`` unset), the lowering gives a layer of more than 16 experts 16 lanes and
a smaller one a region per expert (:func:`torch2step.lower.context.default_moe_lanes`).
Whether that fits depends on the input as well as the chip: a unit's buffers grow with the
tokens it holds, and a buffer larger than one core's SRAM takes extra cores (at batch 1024 the
16 lanes of Qwen3-30B-A3B's 128 experts need 1234 cores of the 1040 of ``step-sda``).

:func:`report_fitting` therefore makes a report under the user's options and, when it fails
with a :class:`ScheduleError` that fewer lanes could cure and the user left ``moe_lanes`` to
the default, makes it again with half the lanes, then half of that, down to 2
(:func:`fewer_lanes`).  The lane count taken goes into the report's notes and options; an
explicit ``moe_lanes`` (``0``: a region per expert) is never changed.  When none fits, the
first error is raised with :func:`fit_suggestions` (the options that need fewer cores), and
says which lane counts were tried.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch2step.errors import ScheduleError, Torch2StepError
from torch2step.lower.context import default_moe_lanes

__all__ = [
    "fewer_lanes",
    "fit_suggestions",
    "report_fitting",
]

log = logging.getLogger("torch2step")


def fewer_lanes(num_experts: int, lanes: int) -> list[int]:
    """The lane counts below ``lanes`` (``0``: one per expert, i.e. ``num_experts``) to try, in
    order: halving, down to 2."""
    r = num_experts if lanes <= 0 else lanes
    out = []
    while r // 2 >= 2:
        r //= 2
        out.append(r)
    return out


def _kinds(kind: str, layer: Any = None, error: Exception | None = None) -> set[str]:
    """Which of ``moe`` / ``attention`` a layer of registered ``kind`` holds (``layer``: its
    layer graph adds its operators), narrowed to the operator ``error`` names as not fitting
    (``operators``: :func:`torch2step.configurations.split_layer`)."""
    from torch2step.layers import ops as L

    has = set()
    if kind in ("moe", "attention"):
        has.add(kind)
    if layer is not None:
        if any(True for _ in layer.ops(L.MoEExperts)):
            has.add("moe")
        if any(True for _ in layer.ops(L.Attention)):
            has.add("attention")
    named = getattr(error, "operators", None)
    if named is not None:
        has &= {{"MoEExperts": "moe", "Attention": "attention"}.get(k, k) for k in named}
    return has


def fit_suggestions(
    kind: str,
    options: Mapping[str, Any],
    layer: Any = None,
    error: Exception | None = None,
    tried: tuple[int, ...] = (),
) -> list[str]:
    """Compile options that reduce the number of units a layer needs: ``kind`` is the
    registered layer's kind; ``layer`` (its layer graph) adds those of the operators it holds
    (a decoder layer's experts and attention), unless ``error`` names the one operator kind
    that does not fit; ``tried``: lane counts already tried (not suggested again)."""
    has = _kinds(kind, layer, error)
    out = []
    if "moe" in has:
        lanes = options.get("moe_lanes")
        experts = _experts(layer)
        if experts is not None:
            now = default_moe_lanes(experts) if lanes is None else lanes
            fewer = fewer_lanes(experts, now)
        else:
            fewer = [k for k in (8, 4, 2) if lanes is None or lanes == 0 or k < lanes]
        out += [f"--option moe_lanes={k}" for k in fewer if k not in tried][:3]
    if "attention" in has:
        out.append(f"--option tile_kv={2 * int(options.get('tile_kv') or 64)}")
    out.append("a chip with more cores (--set num_cores=... with noc.rows/noc.cols)")
    return out


def _experts(layer: Any) -> int | None:
    from torch2step.layers import ops as L

    counts = [n.op.num_experts for n in layer.ops(L.MoEExperts)] if layer is not None else []
    return counts[0] if counts else None


def report_fitting(
    make: Callable[[dict[str, Any]], Any],
    run: Callable[[Any, list[str]], Any],
    kind: str,
    options: Mapping[str, Any],
    notes: list[str],
    chip: str,
) -> tuple[Any, Any, dict[str, Any]]:
    """``(program, report, options)``: the report ``run(program, notes)`` of the program
    ``make(options)`` compiles, with fewer expert lanes than the default when the default does
    not fit (module docstring), whose note is then appended to ``notes``; ``kind``: the
    registered layer's kind (``decoder`` for a config); ``chip``: its name, for the note."""
    opts = dict(options)
    prog = make(opts)
    try:
        return prog, run(prog, notes), opts
    except ScheduleError as first:
        layer = getattr(prog, "layer", None) or getattr(getattr(prog, "body", None), "layer", None)
        experts = _experts(layer)
        if "moe_lanes" in opts or experts is None or "moe" not in _kinds(kind, layer, first):
            fixes = fit_suggestions(kind, opts, layer, first)
            raise ScheduleError(_with_fixes(first, fixes)) from None
        default = default_moe_lanes(experts)
        why = _why(first)
        tried: list[int] = []
        for lanes in fewer_lanes(experts, default):
            tried.append(lanes)
            log.info("the default expert lanes do not fit %s: trying moe_lanes=%d", chip, lanes)
            here = {**opts, "moe_lanes": lanes}
            usual = f"{default} lanes" if default else f"a region per expert ({experts})"
            note = (
                f"expert lanes: {lanes} (moe_lanes={lanes}, STeP §5.3): the default, {usual}, "
                f"does not fit {chip} at this input ({why})"
                + (f"; nor do {', '.join(map(str, tried[:-1]))} lanes" if len(tried) > 1 else "")
                + f"; --option moe_lanes={default} keeps the default"
            )
            try:  # a lane count that fails otherwise (e.g. to lower) is passed over too
                prog = make(here)
                rep = run(prog, [*notes, note])
            except Torch2StepError as e:
                log.info("moe_lanes=%d: %s", lanes, str(e).split("\n")[0])
                continue
            notes.append(note)
            return prog, rep, here
        fixes = fit_suggestions(kind, opts, layer, first, tuple(tried))
        said = ", ".join(str(k) for k in tried)
        raise ScheduleError(
            _with_fixes(first, fixes, f"expert lanes {said} were tried: they do not fit either")
        ) from None


def _why(err: ScheduleError) -> str:
    """What a fit error says in a few words: the cores (or units) needed and the chip's."""
    text = str(err).split("\n")[0]
    need = re.search(r"needs (\d+) (cores|units)", text)
    has = re.search(r"has (\d+) cores", text)
    if need and has:
        return f"it needs {need.group(1)} {need.group(2)}, the chip has {has.group(1)} cores"
    return text.split("; ")[0][:160]


def _with_fixes(err: ScheduleError, fixes: list[str], tried: str = "") -> str:
    line = f"to make it fit, try (each needs fewer cores): {'; or '.join(fixes)}"
    return f"{err}\n  {line}" + (f" ({tried})" if tried else "")
