"""End-to-end CPU and wall seconds of the full-size ``torch2step report`` of every shipped layer.

    python benchmarks/report_speed.py                        # every layer at batch 64
    python benchmarks/report_speed.py --batch 1024 --layers qwen3-moe llama-gqa

Each report runs as ``torch2step report --layer L --batch B -q`` in a child process (this
script's ``--child`` mode, which runs the command's ``main`` as the process, as ``python -m
torch2step.cli`` does) started from this repository (so its sources are imported), with a fixed
``PYTHONHASHSEED``; the figure is the child's user + system CPU seconds (``getrusage``), which on
a shared machine is the report's own cost where wall time is not.  It covers everything the
command does: imports, building the layer on the meta device, compiling, the timing run of the
interpreter, the spatial plan and the simulation.  The latency line of each report is printed
next to it, so runs of two versions can be compared for identical cycles as well as for time.
The wall seconds are the child's from start to exit: a layer split into configurations reports
them in worker processes side by side (:mod:`torch2step.config_jobs`), so on two cores its
wall time is below its CPU time (which counts the workers too).  ``build`` is the wall time
of building the layer (``models.registry.get_layer``: importing the library that defines it,
e.g. transformers for a decoder layer, and constructing the module with its weights on the
``meta`` device), measured in the child; ``wall - build`` is the report's own end-to-end wall
time, the figure a target that excludes weight building compares with.

``--phases`` also splits each report's CPU seconds by phase, measured in the child with
``time.process_time`` around the pipeline's stages (each second counted once: a stage called
inside another pauses it): imports up to the command, building the layer, capture
(``torch.export`` and its decomposition), raising, lowering (with the one-operator lowerings
that split a layer into configurations), the timing run of the STeP interpreter, the symbolic
§4.1 metrics (STeP arXiv 2511.07776 §4.1: the HBM and on-chip formulas the report prints, built
and evaluated), the
spatial plan, program validation, the stand-in weights and inputs of a layer split into
configurations and the values that steer their control (the router's logits:
``configurations._Values``), the simulator's setup (building each core's program state),
the search for the FIFOs to deepen (the untimed replay, ``fifos._replay_deep``, and the resumed
runs of ``fifos.discover_deep``), the timed simulation and the report's
records.  The child runs the command as the process (as ``python -m torch2step.cli`` does), so
its exit is the command's; ``startup+exit`` is what the parent measured outside the child's
own clock (the interpreter's start before the imports, its teardown after the command), and
``other`` the rest of the command: the imports of the later stages made when first used
(``torch2step.spatial``), the cycle collector's first pass over what the plan and the
validation allocated while they held it off (``gc.enable`` at their end), configurations'
bookkeeping and the text (about 1 s of a report at batch 64).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _layers() -> list[str]:
    from models import LAYERS

    return list(LAYERS)


#: (phase, module, attribute): the stages ``--phases`` times (module docstring)
PHASES = (
    ("build layer", "models.registry", "get_layer"),
    ("stand-ins", "torch2step.configurations", "_Values.__init__"),
    ("layer values", "torch2step.configurations", "_Values.value"),
    ("capture", "torch2step.frontend.capture", "capture"),
    ("raise", "torch2step.frontend.torch_import", "from_exported"),
    ("lower", "torch2step.lower.lower", "lower"),
    ("interpreter", "torch2step.step.interpreter", "run"),
    ("metrics", "torch2step.step.metrics", "metrics"),
    ("metrics", "torch2step.step.metrics", "Metrics.evaluate"),
    ("plan", "torch2step.spatial.plan", "build_plan"),
    ("validate", "lowering.validate", "validate_programs"),
    ("simulator setup", "runtime.engine", "Simulator.__init__"),
    ("replay (FIFO depths)", "torch2step.spatial.fifos", "_replay_deep"),
    ("replay (FIFO depths)", "torch2step.spatial.fifos", "discover_deep"),
    ("simulation", "runtime.engine", "Simulator.run"),
    ("report records", "torch2step.program", "_make_report"),
    ("report records", "torch2step.program", "_with_context"),
)


def _build_timed() -> dict[str, float]:
    """Time ``get_layer`` in wall seconds (accumulated in the returned dict's ``build``)."""
    import time

    import models.registry as registry

    took = {"build": 0.0}
    fn = registry.get_layer

    def get_layer(*a: object, **k: object) -> object:
        t = time.perf_counter()
        try:
            return fn(*a, **k)  # type: ignore[arg-type]
        finally:
            took["build"] += time.perf_counter() - t

    registry.get_layer = get_layer  # type: ignore[assignment]
    for m in list(sys.modules.values()):  # also where it was imported by name
        if getattr(m, "get_layer", None) is fn:
            m.get_layer = get_layer  # type: ignore[attr-defined]
    return took


def _timed_child(argv: list[str], phases: bool) -> None:
    """Run ``torch2step report`` in this process with the wall time of building the layer
    measured and (``phases``) :data:`PHASES` timed; print them as ``build`` and ``phases``
    JSON lines on stderr."""
    import importlib
    import json
    import time

    t0 = time.process_time()
    from torch2step.cli import main as cli_main

    took = _build_timed()
    if not phases:
        sys.argv = ["torch2step", "report", *argv]
        try:
            code = cli_main()
        finally:
            print("build " + json.dumps(took), file=sys.stderr, flush=True)
        raise SystemExit(code)
    spent: dict[str, float] = {"imports": time.process_time() - t0}
    stack: list[list] = []  # [label, start] of the phases under way, innermost last

    def timed(label: str, fn: object) -> object:
        def run(*a: object, **k: object) -> object:
            if any(f[0] == label for f in stack):  # a nested call is counted by the outermost
                return fn(*a, **k)  # type: ignore[operator]
            now = time.process_time()
            if stack:  # the enclosing phase pauses: each second is counted once
                outer = stack[-1]
                spent[outer[0]] = spent.get(outer[0], 0.0) + now - outer[1]
            stack.append([label, now])
            try:
                return fn(*a, **k)  # type: ignore[operator]
            finally:
                now = time.process_time()
                _, start = stack.pop()
                spent[label] = spent.get(label, 0.0) + now - start
                if stack:
                    stack[-1][1] = now

        return run

    for label, mod_name, attr in PHASES:
        mod = importlib.import_module(mod_name)
        owner_name, _, name = attr.rpartition(".")
        owner = getattr(mod, owner_name) if owner_name else mod
        fn = getattr(owner, name)
        wrapped = timed(label, fn)
        setattr(owner, name, wrapped)
        if not owner_name:  # also where it was imported by name
            for m in list(sys.modules.values()):
                if getattr(m, name, None) is fn:
                    setattr(m, name, wrapped)
    sys.argv = ["torch2step", "report", *argv]
    try:
        code = cli_main()  # the command as the process: its exit is the command's
    finally:
        spent["total"] = time.process_time() - t0
        print("phases " + json.dumps(spent), file=sys.stderr, flush=True)
        print("build " + json.dumps(took), file=sys.stderr, flush=True)
    raise SystemExit(code)


def report_cpu(
    layer: str, batch: int, extra: list[str], phases: bool = False
) -> tuple[float, float, float, str, dict[str, float]]:
    """CPU seconds of one report in a child process (its configuration workers included),
    its wall seconds, the wall seconds of building the layer, its latency line and
    (``phases``) its CPU seconds by phase (measured with the configurations reported one after
    another in the child, and the §4.1 formulas computed in it rather than beside it in a
    forked child, :mod:`torch2step.background`: ``TORCH2STEP_JOBS=1``)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    if phases:
        env["TORCH2STEP_JOBS"] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    head = [str(Path(__file__).resolve()), "--child-phases" if phases else "--child"]
    out = subprocess.run(
        [
            sys.executable,
            *head,
            "report",
            "--layer",
            layer,
            "--batch",
            str(batch),
            "-q",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    import json

    split: dict[str, float] = {}
    build = 0.0
    for ln in out.stderr.splitlines():
        if ln.startswith("phases "):
            split = json.loads(ln[len("phases ") :])
        elif ln.startswith("build "):
            build = json.loads(ln[len("build ") :])["build"]
    if out.returncode != 0:
        err = [
            ln for ln in out.stderr.strip().splitlines() if not ln.startswith(("phases ", "build "))
        ]
        return cpu, wall, build, f"failed: {err[-1:]}", split
    line = next((ln.strip() for ln in out.stdout.splitlines() if "latency" in ln), "?")
    return cpu, wall, build, line, split


def main() -> None:
    if sys.argv[1:2] in (["--child"], ["--child-phases"]):  # a report's child: argv[2] is "report"
        _timed_child(sys.argv[3:], sys.argv[1] == "--child-phases")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", nargs="*", default=None, help="default: every shipped layer")
    ap.add_argument("--phases", action="store_true", help="also print CPU seconds by phase")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="more report arguments after --")
    args = ap.parse_args()
    extra = [a for a in args.extra if a != "--"]
    for layer in args.layers or _layers():
        cpu, wall, build, line, split = report_cpu(layer, args.batch, extra, args.phases)
        print(
            f"{layer:18s} batch {args.batch:5d}  {cpu:7.2f} CPU s  {wall:7.2f} wall s  "
            f"{build:5.2f} build  {wall - build:7.2f} wall - build   {line}",
            flush=True,
        )
        if split:
            total = split.pop("total", cpu)
            rest = total - sum(split.values())
            parts = [f"{k} {v:.2f}" for k, v in split.items()] + [
                f"other {rest:.2f}",
                f"startup+exit {cpu - total:.2f}",
            ]
            print(f"{'':18s} phases: {', '.join(parts)}", flush=True)


if __name__ == "__main__":
    main()
