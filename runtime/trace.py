"""Chrome trace-event output (the JSON format ui.perfetto.dev and chrome://tracing open).

One process per component kind (cores, NoC links, all-to-all ports, HBM channels) and one thread
(track) per component, each span a complete event (``"ph": "X"``).  Time stamps are cycles: one
trace microsecond is one cycle, so spans are exact integers and two runs of the same programs give
byte-identical files (the clock is recorded in ``otherData``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["build_trace"]

_PIDS = {"core": 1, "link": 2, "inject": 3, "eject": 3, "hbm": 4}
_PNAMES = {1: "cores", 2: "noc links", 3: "all-to-all ports", 4: "hbm channels"}


def build_trace(
    core_spans: Iterable[tuple[int, int, int, str]],
    res_spans: Iterable[tuple[int, int, int, str]],
    res_names: Sequence[str],
    res_kinds: Sequence[str],
    core_names: Sequence[str],
) -> tuple[dict[str, Any], ...]:
    """Trace events from ``(core, start, end, name)`` and ``(resource, start, end, label)``
    spans; metadata names every track that has a span."""
    events: list[dict[str, Any]] = []
    core_tracks: set[int] = set()
    res_tracks: set[int] = set()
    for cid, start, end, name in core_spans:
        core_tracks.add(cid)
        cat = name if name.startswith("stall") else "compute"
        events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": start,
                "dur": end - start,
                "pid": 1,
                "tid": cid,
            }
        )
    for rid, start, end, label in res_spans:
        res_tracks.add(rid)
        kind = res_kinds[rid]
        events.append(
            {
                "name": label,
                "cat": kind,
                "ph": "X",
                "ts": start,
                "dur": end - start,
                "pid": _PIDS[kind],
                "tid": rid,
            }
        )
    meta: list[dict[str, Any]] = []
    pids = {1} if core_tracks else set()
    pids |= {_PIDS[res_kinds[r]] for r in res_tracks}
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
    return tuple(meta + events)
