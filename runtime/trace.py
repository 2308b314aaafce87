"""Chrome trace-event output (the JSON format ui.perfetto.dev and chrome://tracing open).

One process per component kind (cores, NoC links, all-to-all ports, HBM channels) and one thread
(track) per component, each span a complete event (``"ph": "X"``).  Time stamps are cycles: one
trace microsecond (the format's unit) is one cycle.  Core spans start and end on whole cycles;
NoC link, port and HBM spans may start and end between cycles (a transfer's time is its bytes
over the bandwidth), so their ``ts`` / ``dur`` can be fractional.  Two runs of the same programs
give byte-identical files (the clock is recorded in ``otherData`` as ``clock_ghz``).

Counter tracks (``"ph": "C"``, process "utilisation") give the busy share of the cores (compute
spans, stalls excluded), of the HBM channels and of the NoC links / ports that carried traffic,
in at most :data:`COUNTER_BUCKETS` equal windows of the run.  :func:`trace_problems` checks
events against the trace-event format (the fields each phase needs, their types);
:func:`write_trace_json` writes strict JSON (no NaN or Infinity, which JSON.parse refuses).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "build_trace",
    "utilisation_counters",
    "trace_problems",
    "write_trace_json",
    "TraceEvents",
    "COUNTER_BUCKETS",
]

_PIDS = {"core": 1, "link": 2, "inject": 3, "eject": 3, "hbm": 4}
_PNAMES = {1: "cores", 2: "noc links", 3: "all-to-all ports", 4: "hbm channels", 5: "utilisation"}
COUNTER_PID = 5
#: Most windows a utilisation counter track is cut into.
COUNTER_BUCKETS = 256


def _busy_per_window(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Busy time of the spans ``[starts, ends)`` inside each window ``[edges[i], edges[i+1])``.

    ``B(t) = sum(max(0, min(t, end) - start))`` is evaluated at the edges with sorted starts
    and ends and prefix sums, so the cost is ``O((spans + windows) log spans)``."""
    if starts.size == 0:
        return np.zeros(len(edges) - 1)
    s = np.sort(starts.astype(np.float64))
    e = np.sort(ends.astype(np.float64))
    cs = np.concatenate(([0.0], np.cumsum(s)))
    ce = np.concatenate(([0.0], np.cumsum(e)))
    ns = np.searchsorted(s, edges, side="left")
    ne = np.searchsorted(e, edges, side="left")
    b = (edges * ns - cs[ns]) - (edges * ne - ce[ne])
    return np.diff(b)


def utilisation_counters(
    core_spans: Sequence[tuple[int, float, float, str]],
    res_spans: Sequence[tuple[int, float, float, str]],
    res_kinds: Sequence[str],
    cycles: float,
    buckets: int = COUNTER_BUCKETS,
) -> dict[str, Any]:
    """Busy share over time: ``{"edges": [...], "compute": [...], "hbm": [...], "noc": [...]}``.

    Each value is the busy time of that kind's components in a window divided by the window's
    length times the number of components (cores that ran a kernel, HBM channels that served
    an access, links or ports that carried traffic)."""
    if cycles <= 0:
        return {"edges": [0.0], "compute": [], "hbm": [], "noc": []}
    n = max(1, min(buckets, int(np.ceil(cycles))))
    edges = np.linspace(0.0, float(cycles), n + 1)
    width = np.diff(edges)
    out: dict[str, Any] = {"edges": edges.tolist()}
    groups: dict[str, tuple[list[float], list[float], set[int]]] = {
        k: ([], [], set()) for k in ("compute", "hbm", "noc")
    }
    for cid, start, end, name in core_spans:
        if not name.startswith("stall"):
            g = groups["compute"]
            g[0].append(start)
            g[1].append(end)
            g[2].add(cid)
    for rid, start, end, _ in res_spans:
        g = groups["hbm" if res_kinds[rid] == "hbm" else "noc"]
        g[0].append(start)
        g[1].append(end)
        g[2].add(rid)
    for kind, (starts, ends, members) in groups.items():
        busy = _busy_per_window(np.asarray(starts), np.asarray(ends), edges)
        share = busy / (width * max(1, len(members)))
        out[kind] = [round(float(v), 6) for v in share]
    return out


def _counter_events(counters: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    edges = counters["edges"]
    for kind in ("compute", "hbm", "noc"):
        for t, v in zip(edges, counters[kind]):
            ts = int(t) if float(t).is_integer() else round(float(t), 3)
            events.append(
                {
                    "name": f"{kind} utilisation",
                    "ph": "C",
                    "ts": ts,
                    "pid": COUNTER_PID,
                    "tid": 0,
                    "args": {"busy": v},
                }
            )
    return events


#: Fields each phase must carry, with their types (the trace-event format's required keys).
_NUM = (int, float)
_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    "X": {"name": (str,), "ts": _NUM, "dur": _NUM, "pid": (int,), "tid": (int,)},
    "B": {"name": (str,), "ts": _NUM, "pid": (int,), "tid": (int,)},
    "E": {"ts": _NUM, "pid": (int,), "tid": (int,)},
    "i": {"name": (str,), "ts": _NUM, "pid": (int,), "tid": (int,)},
    "C": {"name": (str,), "ts": _NUM, "pid": (int,), "args": (dict,)},
    "M": {"name": (str,), "pid": (int,), "args": (dict,)},
}
_METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def trace_problems(doc: Any) -> list[str]:
    """Every way ``doc`` (a parsed ``trace.json``) departs from the trace-event format:
    a ``traceEvents`` list whose events carry the fields their phase (``ph``) needs with the
    right types, non-negative ``ts``/``dur``, numeric counter values, known metadata names."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["the document must be an object with a traceEvents list"]
    problems: list[str] = []
    for k, ev in enumerate(doc["traceEvents"]):
        if len(problems) >= 20:
            problems.append("... (more problems not listed)")
            break
        if not isinstance(ev, dict):
            problems.append(f"event {k}: not an object")
            continue
        ph = ev.get("ph")
        need = _REQUIRED.get(ph)  # type: ignore[arg-type]
        if need is None:
            problems.append(f"event {k}: unknown phase ph={ph!r}")
            continue
        for key, types in need.items():
            v = ev.get(key)
            if not isinstance(v, types) or isinstance(v, bool):
                problems.append(f"event {k} (ph {ph}): {key}={v!r} must be {types[0].__name__}")
        for key in ("ts", "dur"):
            v = ev.get(key)
            if isinstance(v, _NUM) and v < 0:
                problems.append(f"event {k} (ph {ph}): {key}={v} is negative")
        if ph == "C" and isinstance(ev.get("args"), dict):
            bad = [a for a, v in ev["args"].items() if not isinstance(v, _NUM)]
            if bad:
                problems.append(f"event {k}: counter values {bad} must be numbers")
        if ph == "M" and ev.get("name") not in _METADATA:
            problems.append(f"event {k}: unknown metadata event {ev.get('name')!r}")
    return problems


def build_trace(
    core_spans: Iterable[tuple[int, int, int, str]],
    res_spans: Iterable[tuple[int, int, int, str]],
    res_names: Sequence[str],
    res_kinds: Sequence[str],
    core_names: Sequence[str],
    cycles: float | None = None,
    num: Any = None,
) -> TraceEvents:
    """Trace events from ``(core, start, end, name)`` and ``(resource, start, end, label)``
    spans; metadata names every track that has a span; with ``cycles`` (the run's length),
    utilisation counter tracks over the run (:func:`utilisation_counters`); ``num`` rounds a
    resource span's times as its event is made (the spans are kept as given, not copied)."""
    core_spans = core_spans if isinstance(core_spans, list) else list(core_spans)
    res_spans = res_spans if isinstance(res_spans, list) else list(res_spans)
    core_tracks = {span[0] for span in core_spans}
    res_tracks = {span[0] for span in res_spans}
    counter_events: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []
    pids = {1} if core_tracks else set()
    pids |= {_PIDS[res_kinds[r]] for r in res_tracks}
    if cycles:
        pids.add(COUNTER_PID)
        counters = utilisation_counters(core_spans, res_spans, res_kinds, cycles)
        counter_events = _counter_events(counters)
    for pid in sorted(pids):
        meta.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": _PNAMES[pid]},
            }
        )
        meta.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
    for cid in sorted(core_tracks):
        meta.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 1,
                "tid": cid,
                "args": {"name": core_names[cid]},
            }
        )
        meta.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 1,
                "tid": cid,
                "args": {"sort_index": cid},
            }
        )
    for rid in sorted(res_tracks):
        pid = _PIDS[res_kinds[rid]]
        meta.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": rid,
                "args": {"name": res_names[rid]},
            }
        )
        meta.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": rid,
                "args": {"sort_index": rid},
            }
        )
    return TraceEvents(meta, core_spans, res_spans, res_kinds, counter_events, num)


class TraceEvents(Sequence):
    """The trace's events, made one at a time from the simulator's compact span tuples: the
    metadata, one complete event per core span, one per resource span, then the counters.

    Holding spans as tuples instead of event dictionaries keeps a long run's trace several
    times smaller in memory; iterate it (or :func:`write_trace_json`) to write it out."""

    def __init__(
        self,
        meta: list[dict[str, Any]],
        core_spans: list[tuple[int, Any, Any, str]],
        res_spans: list[tuple[int, Any, Any, str]],
        res_kinds: Sequence[str],
        counters: list[dict[str, Any]],
        num: Any = None,
    ) -> None:
        self._meta, self._core, self._res = meta, core_spans, res_spans
        self._kinds, self._counters = list(res_kinds), counters
        self._num = num or (lambda x: x)

    def __len__(self) -> int:
        return len(self._meta) + len(self._core) + len(self._res) + len(self._counters)

    def _core_event(self, span: tuple[int, Any, Any, str]) -> dict[str, Any]:
        cid, start, end, name = span
        cat = name if name.startswith("stall") else "compute"
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start,
            "dur": end - start,
            "pid": 1,
            "tid": cid,
        }

    def _res_event(self, span: tuple[int, Any, Any, str]) -> dict[str, Any]:
        rid, start, end, label = span
        start, end = self._num(start), self._num(end)
        kind = self._kinds[rid]
        return {
            "name": label,
            "cat": kind,
            "ph": "X",
            "ts": start,
            "dur": end - start,
            "pid": _PIDS[kind],
            "tid": rid,
        }

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(index)
        for part, make in (
            (self._meta, None),
            (self._core, self._core_event),
            (self._res, self._res_event),
            (self._counters, None),
        ):
            if index < len(part):
                return make(part[index]) if make else part[index]
            index -= len(part)
        raise IndexError(index)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self._meta
        for span in self._core:
            yield self._core_event(span)
        for span in self._res:
            yield self._res_event(span)
        yield from self._counters

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def _whole(x: Any) -> Any:
    """``x`` as an int when it is a whole number (a window bound of 1000.0 writes 1000)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _dumps(ev: Any) -> str:
    import json

    try:
        return json.dumps(ev, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise ValueError(
            f"trace event {ev!r} holds NaN or an infinity, which JSON cannot carry"
        ) from None


def write_trace_json(
    path: Any,
    events: Iterable[dict[str, Any]],
    other: dict[str, Any],
    *,
    window: tuple[float, float] | None = None,
    cores: set[int] | None = None,
    cycles: float | None = None,
) -> dict[str, int]:
    """Write ``events`` to ``path`` as a trace-event JSON document, one event at a time (the
    document is never held in memory as one string).  The JSON is strict: a NaN or infinite
    value raises :class:`ValueError` instead of writing ``NaN`` / ``Infinity``.

    ``window``: keep only ``[start, end)`` cycles (``end`` may be ``inf``): spans overlapping
    it are clipped to it (a clipped span's ``args.span`` holds its full ``[start, end]``),
    counter samples inside it are kept and each counter's value in force at ``start`` is
    written at ``start`` (not when ``start`` is at or past ``cycles``, the run's length);
    ``cores``: keep only these cores' spans (NoC, HBM and counter tracks are all kept).
    With either, metadata name only the tracks (and processes) that still have events; the
    metadata are then written before the events from a temporary file beside ``path``.
    Returns ``{"events": written, "dropped": left out, "bytes": file size}``."""
    import shutil
    import tempfile
    from pathlib import Path

    p = Path(path)
    written = dropped = 0
    if window is None and cores is None:
        with p.open("w", encoding="utf-8") as f:
            f.write('{"traceEvents":[')
            for ev in events:
                f.write(("," if written else "") + "\n" + _dumps(ev))
                written += 1
            f.write("\n]," + _dumps({"otherData": other})[1:])
        return {"events": written, "dropped": 0, "bytes": p.stat().st_size}

    lo, hi = window if window is not None else (0, float("inf"))
    lo, hi = _whole(lo), _whole(hi)
    meta: list[dict[str, Any]] = []
    tracks: set[tuple[Any, Any]] = set()  # (pid, tid) of the spans kept
    pids: set[Any] = set()  # processes with events kept
    before: dict[tuple[Any, ...], dict[str, Any]] = {}  # each counter's last sample before lo
    at_lo: set[tuple[Any, ...]] = set()  # counters with a sample at lo
    with tempfile.TemporaryFile("w+", encoding="utf-8", dir=p.parent) as body:
        for ev in events:
            ph = ev.get("ph")
            if ph == "M":
                meta.append(ev)
                continue
            if cores is not None and ev.get("pid") == 1 and ev.get("tid") not in cores:
                dropped += 1
                continue
            if ph == "X":
                ts, end = ev["ts"], ev["ts"] + ev["dur"]
                if not (ts < hi and (end > lo or (ts >= lo and ev["dur"] == 0))):
                    dropped += 1
                    continue
                if ts < lo or end > hi:
                    t0, t1 = max(ts, lo), min(end, hi)
                    args = {**ev.get("args", {}), "span": [ts, end]}
                    ev = {**ev, "ts": t0, "dur": t1 - t0, "args": args}
                tracks.add((ev.get("pid"), ev.get("tid")))
            elif ph == "C":
                key = (ev.get("pid"), ev.get("tid"), ev.get("name"), ev.get("id"))
                if ev["ts"] < lo:
                    held = before.get(key)
                    if held is None or ev["ts"] >= held["ts"]:
                        before[key] = ev
                    dropped += 1
                    continue
                if ev["ts"] >= hi:
                    dropped += 1
                    continue
                if ev["ts"] == lo:
                    at_lo.add(key)
            body.write(",\n" + _dumps(ev))
            pids.add(ev.get("pid"))
            written += 1
        if cycles is None or lo < cycles:  # the counters' values in force at lo
            for key, ev in before.items():
                if key not in at_lo:
                    body.write(",\n" + _dumps({**ev, "ts": lo}))
                    pids.add(ev.get("pid"))
                    written += 1
        kept = []
        for ev in meta:
            if ev.get("name", "").startswith("process_"):
                keep = ev.get("pid") in pids
            else:
                keep = (ev.get("pid"), ev.get("tid")) in tracks
            if keep:
                kept.append(ev)
            else:
                dropped += 1
        with p.open("w", encoding="utf-8") as f:
            f.write('{"traceEvents":[')
            f.write(",".join("\n" + _dumps(ev) for ev in kept))
            body.seek(0)
            if not kept:
                body.read(1)  # the first event's leading comma
            shutil.copyfileobj(body, f)
            f.write("\n]," + _dumps({"otherData": other})[1:])
    return {"events": written + len(kept), "dropped": dropped, "bytes": p.stat().st_size}
