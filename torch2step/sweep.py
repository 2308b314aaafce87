"""Design-space sweeps: the product of layers x batches x chips x options x traces.

A spec (YAML or a dict)::

    layers: [qwen3-moe]
    batches: [8, 16]
    chips:                       # a preset, a YAML file, or a chip with overrides
      - step-sda
      - {chip: step-sda, set: [hbm.channels=64]}
    options: [{}, {moe_lanes: 4}, [strategy=auto]]   # mappings or KEY=VALUE lists
    traces: [auto]               # routing trace (MoE) / KV trace (attention, decoder) per point
    tiny: true

:func:`points` expands it; :func:`run_sweep` runs every point on a local process pool
(``backend="pool"``) or on Ray (``backend="ray"``; ``address`` of a cluster, else a local Ray),
shows a progress bar with an ETA, and caches each finished point in ``out/points/<hash>.json``
where the hash covers the point's inputs, the resolved chip description, the content of its
trace file and the package version, so a rerun skips finished points (Ctrl-C cancels the rest:
:class:`SweepInterrupted`).  Chip and trace files are found relative to the spec file.  A point that fails is recorded with its error and
the sweep goes on.  A point on an inter-core-connected chip runs kernel by kernel at full size
(:func:`_kernel_row`; the ``execution`` column).  Results: ``results.csv`` (one row per point,
ordered as the spec),
``results.parquet`` when pyarrow is installed, ``latency_vs_batch.png`` and ``pareto.png``.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import yaml

from torch2step.errors import InputError

__all__ = [
    "load_spec",
    "points",
    "point_hash",
    "run_point",
    "run_sweep",
    "SweepInterrupted",
    "ROW_COLUMNS",
]

log = logging.getLogger("torch2step")

ROW_COLUMNS = (
    "layer",
    "batch",
    "chip",
    "chip_name",
    "execution",
    "options",
    "trace",
    "tiny",
    "status",
    "error",
    "latency_cycles",
    "latency_s",
    "hbm_bytes",
    "flops",
    "peak_onchip_bytes",
    "roofline_fraction",
    "hbm_bandwidth_fraction",
    "cores_used",
    "cores_available",
    "notes",
    "hash",
)
_KEYS = {"layers", "batches", "chips", "options", "traces", "tiny", "impl"}
_OPTION_FORMS = (
    "an option set is a mapping {tile_rows: 32} or a list of KEY=VALUE strings [tile_rows=32]"
)


def load_spec(spec: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A sweep spec from a YAML file or a mapping; chip files are resolved relative to it."""
    base = Path(".")
    if not isinstance(spec, Mapping):
        path = Path(spec)
        if not path.is_file():
            raise InputError(f"sweep spec {str(path)!r}: no such file")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise InputError(f"sweep spec {path}: not valid YAML: {e}") from None
        base = path.parent
    else:
        data = dict(spec)
    if not isinstance(data, Mapping):
        raise InputError("sweep spec: must be a mapping with keys " + ", ".join(sorted(_KEYS)))
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise InputError(f"sweep spec: unknown keys {unknown}; valid: {', '.join(sorted(_KEYS))}")
    for key in ("layers", "batches"):
        if not isinstance(data.get(key), list) or not data[key]:
            raise InputError(f"sweep spec: {key} must be a non-empty list")
    out = dict(data)
    for key in ("chips", "traces"):  # (options: checked with the option sets)
        if data.get(key) is not None and not isinstance(data[key], list):
            raise InputError(
                f"sweep spec: {key} must be a list (e.g. {key}: [{_EXAMPLE[key]}]), "
                f"not {data[key]!r}"
            )
    chips = []
    for c in data.get("chips") or ["step-sda"]:
        entry = {"chip": c, "set": []} if isinstance(c, str) else dict(c)
        if set(entry) - {"chip", "set"} or "chip" not in entry:
            raise InputError(f"sweep spec: chip entry {c!r} must be a name/path or {{chip, set}}")
        p = base / str(entry["chip"])
        if str(entry["chip"]).endswith((".yaml", ".yml")) and p.is_file():
            entry["chip"] = str(p.resolve())
        entry["set"] = [str(s) for s in entry.get("set") or []]
        chips.append(entry)
    out["chips"] = chips
    out["options"] = data.get("options") or [{}]
    out["traces"] = [_trace_path(base, str(t)) for t in data.get("traces") or ["auto"]]
    _check_spec(out)
    return out


#: (load_spec) an entry of each list key, for the message of a key given a single value
_EXAMPLE = {"chips": "step-sda", "traces": "auto"}


def _trace_path(base: Path, trace: str) -> str:
    """A trace file named relative to the spec's folder, as its absolute path (a trace name,
    ``auto``, ``router``, or a file not found there: as written)."""
    if trace in ("auto", "router"):
        return trace
    p = base / trace
    return str(p.resolve()) if p.is_file() else trace


def _check_spec(spec: Mapping[str, Any]) -> None:
    """Every problem of a sweep spec's layers, batches, chips and options at once, before
    any point runs (an :class:`InputError` naming each in the spec's terms)."""
    from models import LAYERS
    from torch2step.named import parse_options, resolve_chip

    why = []
    for layer in spec["layers"]:
        if layer not in LAYERS:
            close = difflib.get_close_matches(str(layer), list(LAYERS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            why.append(f"layers: {layer!r} is not a registered layer{hint}")
    for b in spec["batches"]:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            why.append(f"batches: {b!r} is not a positive integer")
    tiny = spec.get("tiny", False)
    if not isinstance(tiny, bool):
        why.append(f"tiny: {tiny!r} is not a boolean; write true or false")
    impl = spec.get("impl")
    if impl is not None and not isinstance(impl, str):
        why.append(f"impl: {impl!r} is not an implementation name")
    sets = spec["options"]
    if not isinstance(sets, list):
        why.append(f"options: {sets!r} is not a list of option sets; {_OPTION_FORMS}")
        sets = []
    parsed = []
    for opts in sets:
        try:
            if isinstance(opts, Mapping):
                parsed.append(parse_options(opts))
            elif isinstance(opts, list) and all(isinstance(o, str) and "=" in o for o in opts):
                parsed.append(parse_options(opts))  # ["KEY=VALUE", ...], as --option takes
            else:
                why.append(f"options: {opts!r} is not an option set; {_OPTION_FORMS}")
        except InputError as e:
            why.append(f"options: {str(e).removeprefix('--option ')}")
    spec["options"] = parsed
    for entry in spec["chips"]:
        try:
            chip = resolve_chip(entry["chip"], entry["set"])
        except InputError as e:
            why.append(f"chips: {str(e).removeprefix('--chip/--set: ')}")
            continue
        if chip.execution != "kernel":
            continue
        # an inter-core-connected chip's points run the full-size layer kernel by kernel
        # (_kernel_row): no tiny layer, no options of a STeP program
        name = _label({"chip": entry["chip"], "set": entry["set"]})
        if tiny is True:
            why.append(
                f"chips: {name} runs kernel by kernel, timing the full-size layer: tiny: true "
                "does not apply to it (set tiny: false, or sweep it in a spec of its own)"
            )
        shaped = [o for o in parsed if o]
        if shaped:
            why.append(
                f"chips: {name} runs kernel by kernel: options {', '.join(map(str, shaped))} "
                "shape a STeP program (spatial execution) and do not apply to it (give it "
                "options: [{}], or sweep it in a spec of its own)"
            )
    if len(why) == 1:
        raise InputError(f"sweep spec: {why[0]}")
    if why:
        raise InputError(f"sweep spec: {len(why)} problems:\n" + "\n".join(f"  - {w}" for w in why))


def points(spec: str | Path | Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every point of ``spec`` (:func:`load_spec`), in a fixed order."""
    s = load_spec(spec)
    out = []
    for layer, batch, chip, opts, trace in itertools.product(
        s["layers"], s["batches"], s["chips"], s["options"], s["traces"]
    ):
        out.append(
            {
                "layer": layer,
                "batch": int(batch),
                "chip": chip["chip"],
                "set": list(chip["set"]),
                "options": dict(sorted(opts.items())),
                "trace": trace,
                "tiny": bool(s.get("tiny", False)),
                "impl": s.get("impl"),
            }
        )
    return out


def point_hash(point: Mapping[str, Any]) -> str:
    """Hash of a point's inputs, its resolved chip description, the content of its trace file
    and the package version."""
    from hwmodel import to_dict
    from torch2step.named import resolve_chip

    try:
        chip = to_dict(resolve_chip(point["chip"], point["set"]))
    except InputError as e:
        chip = {"error": str(e)}
    from torch2step import __version__

    inputs = {"point": point, "chip": chip, "version": __version__}
    digest = _file_digest(point["trace"])
    if digest is not None:  # a trace file: its content (a trace name: as before)
        inputs["trace"] = digest
    blob = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _file_digest(path: str) -> str | None:
    """The SHA-256 of the bytes of the trace file a point reads (its routing or KV lengths),
    so an edited file re-runs the point; None for a trace name (the package version covers
    the packaged traces)."""
    p = Path(path)
    if path in ("auto", "router") or not p.is_file():
        return None
    digest = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _label(point: Mapping[str, Any]) -> str:
    name = Path(point["chip"]).stem if os.sep in str(point["chip"]) else str(point["chip"])
    return name + (f"[{','.join(point['set'])}]" if point["set"] else "")


#: ``torch2step report`` flags a point's error may name -> the spec field that gave the value
_SPEC_FIELDS = {
    "--routing-trace": "traces",
    "--kv-trace": "traces",
    "--impl": "impl",
    "--tiny": "tiny",
    "--batch": "batches",
    "--option": "options",
    "--chip/--set": "chips",
}


def _spec_terms(message: str) -> str:
    """An error message of the report pipeline with the flags it names put as the spec's
    fields (``--routing-trace x: ...`` -> ``traces x: ...``)."""
    pattern = "|".join(re.escape(f) for f in sorted(_SPEC_FIELDS, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({pattern})(?![\w-])", lambda m: _SPEC_FIELDS[m[1]], message)


def run_point(point: Mapping[str, Any]) -> dict[str, Any]:
    """Simulate one point; a failure becomes a row with ``status`` "error" and the message."""
    from torch2step.errors import Torch2StepError
    from torch2step.named import report_layer, resolve_chip

    row: dict[str, Any] = dict.fromkeys(ROW_COLUMNS, "")
    row.update(
        layer=point["layer"],
        batch=point["batch"],
        chip=_label(point),
        options=json.dumps(point["options"], sort_keys=True),
        trace=point["trace"],
        tiny=point["tiny"],
        hash=point_hash(point),
    )
    from models import LAYERS

    # a point's trace routes a MoE layer, or gives an attention or decoder layer's KV lengths
    # (a MoE decoder layer is routed by its model's packaged trace)
    entry = LAYERS.get(point["layer"])
    is_moe = entry is not None and entry.kind == "moe"
    try:
        chip = resolve_chip(point["chip"], point["set"])
        if chip.execution == "kernel":
            row.update(_kernel_row(point, chip))
            return row
        run = report_layer(
            point["layer"],
            point["batch"],
            point["chip"],
            sets=point["set"],
            options=point["options"],
            routing_trace=point["trace"] if is_moe else "auto",
            kv_trace=point["trace"] if not is_moe else "auto",
            tiny=point["tiny"],
            impl=point.get("impl"),
        )
    except Torch2StepError as e:
        first = (str(e).splitlines() or [""])[0]
        row.update(status="error", error=f"{type(e).__name__}: {_spec_terms(first)}")
        return row
    r = run.report
    row.update(
        chip_name=r.chip,
        execution="spatial",
        status="ok",
        latency_cycles=r.latency_cycles,
        latency_s=r.latency_s,
        hbm_bytes=r.hbm_bytes,
        flops=r.flops,
        peak_onchip_bytes=r.peak_onchip_bytes,
        roofline_fraction=round(r.roofline_fraction, 9),
        hbm_bandwidth_fraction=round(r.hbm_bandwidth_fraction, 9),
        cores_used=r.cores_used,
        cores_available=r.cores_available,
        notes="; ".join(r.notes),
    )
    return row


def _kernel_row(point: Mapping[str, Any], chip: Any) -> dict[str, Any]:
    """A point on an inter-core-connected chip, run as ``torch2step report --chip`` runs it:
    the full-size layer kernel by kernel (ELK-Full plan, per-core programs, timing simulation;
    :func:`torch2step.cli_compare.kernel_layer_report`), a MoE batch routed by the point's
    trace as the spatial rows are, every attention request attending 2048 cached rows."""
    from models import LAYERS
    from torch2step.cli_compare import _moe_routing, kernel_layer_report

    layer, batch = point["layer"], point["batch"]
    if point["tiny"]:
        raise InputError(
            f"chip {chip.name}: kernel-by-kernel execution times the full-size {layer} from "
            "its configuration; set tiny: false for inter-core-connected chips"
        )
    if point["options"]:
        raise InputError(
            f"options {point['options']}: tiling options of the spatial execution; chip "
            f"{chip.name} runs kernel by kernel, give it options: [{{}}]"
        )
    entry = LAYERS[layer]
    notes = ["kernel by kernel (ELK-Full)"]
    routing = None
    if entry.kind == "moe":
        routing, more = _moe_routing(entry, layer, batch, point["trace"])
        notes += more
    elif point["trace"] != "auto":
        raise InputError(
            f"trace {point['trace']!r}: kernel-by-kernel execution times every request "
            f"attending the same number of cached rows; use trace auto for chip {chip.name}"
        )
    else:
        notes.append("KV: every request attends 2048 cached rows")
        if entry.routing_prefix is not None:  # a MoE decoder layer: its model's trace
            routing, more = _moe_routing(entry, layer, batch)
            notes += more
    rep = kernel_layer_report(layer, batch, chip, routing=routing)
    assert rep.result is not None  # a timing simulation keeps its result
    moved = dict(rep.result.stats.bytes_moved)
    cores = rep.result.stats.cores
    return {
        "chip_name": chip.name,
        "execution": "kernel",
        "status": "ok",
        "latency_cycles": rep.cycles,
        "latency_s": chip.cycles_to_seconds(rep.cycles),
        "hbm_bytes": moved.get("hbm_read", 0) + moved.get("hbm_write", 0),
        "flops": sum(op.flops for op in rep.schedule.ops),
        # what the run held: every core's peak, as a spatial row counts its units'
        "peak_onchip_bytes": sum(c.sram_peak_bytes for c in cores),
        "hbm_bandwidth_fraction": round(rep.hbm_util, 9),
        "cores_used": sum(1 for c in cores if c.busy),
        "cores_available": chip.num_cores,
        "notes": "; ".join([*notes, *rep.notes]),
    }


def _progress(total: int, initial: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="point", desc="sweep", dynamic_ncols=True)


def run_point_in_worker(point: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`run_point` in a sweep's worker process: the sweep's workers already take the
    CPUs, so a split layer's configurations are reported one after another in the worker
    (:mod:`torch2step.config_jobs`) unless ``TORCH2STEP_JOBS`` says otherwise."""
    from torch2step.config_jobs import JOBS_ENV

    os.environ.setdefault(JOBS_ENV, "1")
    return run_point(point)


def _ignore_sigint() -> None:
    """A pool worker leaves Ctrl-C to the sweep, which stops it (:func:`_run_pool`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_pool(todo: list[dict], jobs: int, done: Callable[[dict, dict], None]) -> None:
    ex = ProcessPoolExecutor(
        max_workers=jobs, mp_context=get_context("spawn"), initializer=_ignore_sigint
    )
    try:
        futures = {ex.submit(run_point_in_worker, p): p for p in todo}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                done(futures[f], f.result())
    except BaseException:  # Ctrl-C (or a failure): no queued point starts, running ones stop
        _stop_pool(ex)
        raise
    ex.shutdown()


def _stop_pool(ex: ProcessPoolExecutor) -> None:
    """Cancel ``ex``'s queued points and end the points its workers are running."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # a 2nd Ctrl-C waits
    try:
        workers = list((getattr(ex, "_processes", None) or {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            if w.is_alive():
                w.terminate()
        for w in workers:
            w.join(timeout=5)
        ex.shutdown(wait=True)  # the pool's queues closed with it (no semaphore left behind)
    finally:
        if main:
            signal.signal(signal.SIGINT, old)


def _run_ray(todo: list[dict], jobs: int, address: str | None, done: Callable) -> None:
    try:
        import ray
    except ImportError:
        raise InputError("--backend ray: ray is not installed (pip install 'ray>=2.40')") from None
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=jobs, **kwargs)
    try:
        remote = ray.remote(num_cpus=1)(run_point_in_worker)
        refs = {remote.remote(p): p for p in todo}
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    done(refs[ref], ray.get(ref))
        except BaseException:  # Ctrl-C (or a failure): the points not finished are cancelled
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
    finally:
        if started:
            ray.shutdown()


def _write_results(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    from torch2step import plots

    written = [out / "results.csv"]
    with written[0].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pass
    else:
        table = pa.Table.from_pylist([{k: str(v) for k, v in r.items()} for r in rows])
        pq.write_table(table, out / "results.parquet")
        written.append(out / "results.parquet")
    written.append(plots.plot_latency_vs_batch(out / "latency_vs_batch.png", rows, "latency"))
    written.append(plots.plot_pareto(out / "pareto.png", rows, "cycles vs on-chip memory"))
    return written


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a sweep: its queued points were cancelled and its running ones ended;
    the ``finished`` of ``total`` points are cached in ``out/points`` (a rerun resumes)."""

    def __init__(self, finished: int, total: int, out: Path) -> None:
        super().__init__(f"sweep interrupted: {finished} of {total} points finished")
        self.finished, self.total, self.out = finished, total, out


def run_sweep(
    spec: str | Path | Mapping[str, Any],
    out: str | Path,
    *,
    backend: str = "pool",
    jobs: int | None = None,
    address: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every point of ``spec`` not already cached in ``out`` (module docstring); returns
    the rows in the spec's order.  Ctrl-C cancels the points not finished and raises
    :class:`SweepInterrupted` (a :class:`KeyboardInterrupt`); the finished stay cached."""
    if backend not in ("pool", "ray", "serial"):
        raise InputError(f"--backend {backend!r}: choose pool, ray or serial")
    pts = points(spec)
    d = Path(out)
    (d / "points").mkdir(parents=True, exist_ok=True)
    hashes = [point_hash(p) for p in pts]
    rows: dict[str, dict[str, Any]] = {}
    for h in hashes:
        f = d / "points" / f"{h}.json"
        if f.is_file():
            rows[h] = json.loads(f.read_text())
    todo = [p for p, h in zip(pts, hashes) if h not in rows]
    log.info(
        "sweep: %d points, %d cached in %s, %d to run on %s",
        len(pts),
        len(pts) - len(todo),
        d,
        len(todo),
        backend,
    )
    bar = _progress(len(set(hashes)), len(rows)) if progress else None
    t0 = time.perf_counter()

    def done(point: Mapping[str, Any], row: dict[str, Any]) -> None:
        h = row["hash"]
        tmp = d / "points" / f"{h}.json.tmp"
        tmp.write_text(json.dumps(row, sort_keys=True))
        tmp.replace(d / "points" / f"{h}.json")
        rows[h] = row
        if row["status"] != "ok":
            log.warning(
                "point %s %s on %s failed: %s",
                row["layer"],
                row["batch"],
                row["chip"],
                row["error"],
            )
        if bar is not None:
            bar.update(1)

    # batch varies fastest, so a worker's consecutive points share one compiled program
    unique = sorted(
        {point_hash(p): p for p in todo}.values(),
        key=lambda p: json.dumps({**p, "batch": 0}, sort_keys=True) + f"{p['batch']:012d}",
    )
    n = max(1, min(jobs or (os.cpu_count() or 1), len(unique) or 1))
    try:
        if backend == "serial" or not unique:
            for p in unique:
                done(p, run_point(p))
        elif backend == "pool":
            _run_pool(unique, n, done)
        else:
            _run_ray(unique, n, address, done)
    except KeyboardInterrupt:
        finished = sum(h in rows for h in set(hashes))
        raise SweepInterrupted(finished, len(set(hashes)), d) from None
    finally:
        if bar is not None:
            bar.close()
    ordered = [rows[h] for h in hashes]
    _write_results(d, ordered)
    log.info("sweep: %d points in %.1f s -> %s", len(unique), time.perf_counter() - t0, d)
    return ordered
