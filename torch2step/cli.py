"""Command line: ``torch2step report|compare|sweep|import-onnx|mpirun|layers|chips``.

``torch2step report --layer qwen3-moe --batch 64 --chip step-sda`` builds the named layer with
the real model's sizes, compiles it, and simulates it with the real expert-routing or KV-length
trace (packaged in :mod:`models.traces`); ``--out DIR`` writes a run directory (summary.json,
CSVs, a Perfetto trace, plots, report.md).  Bad arguments print one line naming what is
allowed and exit with status 2; errors of the pipeline print one line (no traceback) and exit 1.

Each subcommand is one entry of :data:`COMMANDS`: a function adding its arguments and a
function running it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main", "build_parser", "COMMANDS"]

log = logging.getLogger("torch2step")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(p: argparse.ArgumentParser) -> None:
    """``-v`` / ``-q``: more or less logging on stderr."""
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")


def _chip_args(p: argparse.ArgumentParser) -> None:
    from hwmodel import list_presets

    p.add_argument(
        "--chip", default="step-sda", help=f"preset ({', '.join(list_presets())}) or YAML file"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a chip field, e.g. --set hbm.channels=64 --set noc.link_bytes_per_cycle=128",
    )


def _add_report(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from elk.designs import DESIGNS
    from models import LAYERS
    from torch2step.cli_compare import add_plan_flag

    r = sub.add_parser("report", help="latency report of a named layer on a chip")
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--layer", choices=list(LAYERS), help="a registered layer")
    what.add_argument(
        "--hf-config",
        type=Path,
        help="a HuggingFace config.json: its decoder layer at full size, no weights",
    )
    r.add_argument(
        "--batch", type=int, default=64, help="tokens (MoE) or decode requests (GQA); default 64"
    )
    r.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="with --hf-config: a decode step of N identical layers (one body, repeated)",
    )
    _chip_args(r)
    r.add_argument(
        "--option",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the spatial compile, e.g. --option moe_lanes=4, "
        "--option moe_lane_assign=consecutive or --option strategy=auto (tiling and strategies: "
        "torch2step.lower.LowerOptions; strategy, onchip_budget, compute_budget: "
        "torch2step.compile)",
    )
    r.add_argument(
        "--routing-trace",
        default="auto",
        help="MoE layers and MoE decoder layers: expert choices — a packaged trace name (e.g. qwen_b64), an .npz/.npy file, "
        "'auto' (the model's real trace for this batch; the report says what was used) or "
        "'router' (the layer's own router)",
    )
    r.add_argument(
        "--kv-trace",
        default="auto",
        help="GQA: per-request KV lengths — a packaged trace name or alias (e.g. b64/med), an "
        ".npy file, or 'auto' (the 'med' batch of the Azure trace for this batch size)",
    )
    r.add_argument(
        "--dtype",
        default=None,
        help="element type the layer is built, timed and counted in: bf16, fp16 or fp32 "
        "(default: bf16 for --layer, as served and as the STeP paper evaluates; for "
        "--hf-config the dtype the config says the model is served in)",
    )
    r.add_argument(
        "--execution",
        choices=("auto", "spatial", "kernel"),
        default="auto",
        help="spatial (STeP) or kernel-by-kernel (ELK); auto: kernel on ICCA chips (ipu-hbm, mesh)",
    )
    r.add_argument(
        "--kv-len",
        type=int,
        default=None,
        help="KV cache rows every request attends (kernel execution default 2048; spatial "
        "default: the packaged KV trace of --batch, --kv-trace)",
    )
    r.add_argument(
        "--sim-layers",
        type=int,
        default=None,
        metavar="K",
        help="kernel execution of --layers N: simulate K layers (default min(N, 5); from 5: a "
        "K-layer step planned on its own, the layers in between timed by its steady period; "
        "below 5 the rest is the plan's prediction, an estimate a few percent off)",
    )
    r.add_argument(
        "--design",
        choices=DESIGNS,
        default="elk_full",
        help="kernel execution: the ELK design (ELK §6.1; default elk_full)",
    )
    add_plan_flag(r)
    r.add_argument("--tiny", action="store_true", help="use the layer's tiny test configuration")
    r.add_argument("--impl", default=None, help="the layer's spelling (see `torch2step layers`)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write a run directory: summary.json, CSVs, trace.json, PNG plots, report.md",
    )
    r.add_argument(
        "--trace-window",
        metavar="START:END",
        default=None,
        help="with --out: only cycles START..END in trace.json",
    )
    r.add_argument(
        "--trace-units",
        type=int,
        default=None,
        metavar="N",
        help="with --out: only the N busiest units' core tracks in trace.json",
    )
    return r


def _window(text: str | None) -> tuple[float, float] | None:
    """``--trace-window START:END`` as ``(start, end)`` cycles: ``START`` defaults to 0, an
    empty (or ``inf``) ``END`` is the run's end; text that is no START:END is refused here, the
    values by :func:`torch2step.program.check_trace_limits`."""
    from torch2step.errors import InputError

    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        lo, hi = float(a or 0), float(b) if b else float("inf")
    except ValueError:
        lo, hi = 0.0, -1.0
    if not sep:
        raise InputError(
            f"--trace-window {text!r}: write START:END cycles with 0 <= START < END "
            "(END may be left out: to the run's end)"
        )
    from torch2step.program import check_trace_limits

    check_trace_limits((lo, hi), None, ("--trace-window", "--trace-units"))
    return lo, hi


@contextmanager
def _one_tensor_thread() -> Iterator[None]:
    """PyTorch's intra-op parallelism off while a report runs (restored after it).

    A report's own tensor work is small — the raising's probes on sample-sized tensors, the
    stand-in values that steer control — and its second CPU is taken by its own processes
    (a split layer's configuration workers, the §4.1 formulas computed beside the plan:
    :mod:`torch2step.background`) or by other programs.  A two-thread parallel region then
    waits for a thread that is not scheduled: on a busy two-CPU machine the raising of
    Llama-3-8B attention took 1.2 s with two threads and 0.04 s with one (the same layer
    graph; workers already run with one thread, :mod:`torch2step.config_jobs`)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _run_report(args: argparse.Namespace) -> int:
    with _one_tensor_thread():
        return _report(args)


def _refuse_ignored(args: argparse.Namespace, kernel: bool = False) -> None:
    """Flags this report would not use, refused rather than ignored: an
    :class:`~torch2step.errors.InputError` naming each with what it needs (``kernel``: the
    report runs kernel by kernel, which refuses the run directory's flags itself)."""
    from models import LAYERS
    from torch2step.errors import InputError

    why = []
    if args.layers is not None and args.hf_config is None:
        why.append("--layers N needs --hf-config (a model's config.json)")
    if args.sim_layers is not None and args.layers is None:
        why.append("--sim-layers K needs --hf-config and --layers N (a decode step of N layers)")
    shaping = [
        f
        for f, v in (("--trace-window", args.trace_window), ("--trace-units", args.trace_units))
        if v is not None
    ]
    if shaping and args.out is None and not kernel:
        why.append(
            f"{', '.join(shaping)}: options of the run directory's trace.json; add --out DIR"
        )
    entry = LAYERS.get(args.layer) if args.layer is not None else None
    if entry is not None and not entry.attends_kv:
        kv = [
            f
            for f, v in (("--kv-len", args.kv_len), ("--kv-trace", args.kv_trace != "auto" or None))
            if v
        ]
        if kv:
            why.append(f"{', '.join(kv)}: layer {args.layer} attends no KV cache")
    if entry is not None and entry.routing_prefix is None and args.routing_trace != "auto":
        why.append(f"--routing-trace: layer {args.layer} has no MoE router")
    if why:
        raise InputError("; ".join(why))


def _report(args: argparse.Namespace) -> int:
    from torch2step.named import report_config, report_layer
    from torch2step.program import check_trace_limits

    window = _window(args.trace_window)
    check_trace_limits(None, args.trace_units, ("--trace-window", "--trace-units"))
    if args.execution != "spatial":
        from torch2step.named import resolve_chip

        chip = resolve_chip(args.chip, args.sets)
        if args.execution == "kernel" or chip.execution == "kernel":
            from torch2step.cli_compare import kernel_config_report, kernel_report

            _refuse_ignored(args, kernel=True)
            return (kernel_report if args.layer is not None else kernel_config_report)(args, chip)
    _refuse_ignored(args)
    given = [
        f
        for f, on in (
            ("--design", args.design != "elk_full"),
            ("--plan", args.plan),
            ("--sim-layers", args.sim_layers is not None),
        )
        if on
    ]
    if given:
        from torch2step.errors import InputError

        raise InputError(
            f"{', '.join(given)}: options of the kernel-by-kernel execution (an ELK plan); the "
            "spatial report places a STeP program: drop them, or report on an ICCA chip "
            "(ipu-hbm, mesh) or with --execution kernel"
        )
    if args.hf_config is not None:
        run = report_config(
            args.hf_config,
            args.batch,
            args.chip,
            sets=args.sets,
            options=args.options,
            trace=args.out is not None,
            layers=args.layers,
            dtype=args.dtype,
            routing_trace=args.routing_trace,
        )
    else:
        run = report_layer(
            args.layer,
            args.batch,
            args.chip,
            sets=args.sets,
            options=args.options,
            routing_trace=args.routing_trace,
            kv_trace=args.kv_trace,
            tiny=args.tiny,
            impl=args.impl,
            trace=args.out is not None,
            dtype=args.dtype or "bf16",
            kv_len=args.kv_len,
        )
    if args.out is not None:
        run.report.save(
            args.out, trace=run.program, trace_window=window, trace_units=args.trace_units
        )
        log.info("wrote %s/ (read report.md; open trace.json at ui.perfetto.dev)", args.out)
    print(run.report.to_json() if args.json else run.report)
    return 0


def _add_import_onnx(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    o = sub.add_parser("import-onnx", help="import an ONNX file, compile and report it")
    o.add_argument("file", type=Path)
    _chip_args(o)
    o.add_argument(
        "--tokens",
        type=int,
        default=16,
        help="size given to dynamic dimensions --dim does not name (default 16)",
    )
    o.add_argument(
        "--dim",
        dest="dims",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size of the dynamic dimension NAME (as the import names it; repeatable), e.g. "
        "--dim batch=8 --dim past=2048",
    )
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--print", action="store_true", help="print the layer and STeP graphs")
    return o


def _dim_sizes(items: list[str], graph: Any) -> dict[str, int]:
    """``--dim NAME=SIZE`` pairs, each a dynamic dimension of ``graph``'s inputs (all problems
    at once: an :class:`~torch2step.errors.InputError`)."""
    import sympy as sp

    from torch2step.errors import InputError

    names = sorted(
        {
            str(s)
            for n in graph.inputs
            for d in graph.types[n].shape
            for s in sp.sympify(d).free_symbols
        }
    )

    out, bad = {}, []
    for text in items:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not raw.strip().isdigit() or int(raw) < 1:
            bad.append(f"--dim {text!r}: write NAME=SIZE with a positive integer SIZE")
        elif key not in names:
            bad.append(
                f"--dim {key}: not a dynamic dimension of the inputs; they are "
                f"{', '.join(names) or 'none (every input shape is static)'}"
            )
        else:
            out[key] = int(raw)
    if bad:
        raise InputError("; ".join(bad))
    return out


def _run_import_onnx(args: argparse.Namespace) -> int:
    import torch2step
    from torch2step.errors import InputError
    from torch2step.named import resolve_chip, simulation_progress

    if args.tokens < 1:
        raise InputError(f"--tokens {args.tokens}: must be a positive integer")
    if not args.file.is_file():
        raise InputError(f"{args.file}: no such ONNX file")
    chip = resolve_chip(args.chip, args.sets)
    log.info("importing %s", args.file)
    graph = torch2step.import_onnx(args.file)
    sizes = _dim_sizes(args.dims, graph)
    inputs = torch2step.example_inputs_for(graph, size=args.tokens, sizes=sizes)
    log.info("compiling for %s", chip.name)
    prog = torch2step.compile(graph, inputs, chip=chip)
    if args.print:
        prog.print()
    log.info("simulating")
    if prog.execution == "kernel":  # an ICCA chip: kernel by kernel (the ELK plan's report)
        import json

        with simulation_progress():
            krep = prog.report(tokens=args.tokens)
        head = {"file": str(args.file), "tokens": args.tokens}
        print(json.dumps({**head, **krep.to_dict()}) if args.json else f"{prog.schedule}\n{krep}")
        return 0
    with simulation_progress():
        rep = prog.report(*inputs)
    print(rep.to_json() if args.json else rep)
    return 0


def _add_layers(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser("layers", help="list the registered layers")


def _run_layers(args: argparse.Namespace) -> int:
    from models import LAYERS

    for name, e in LAYERS.items():
        print(f"{name:<12} {e.description}  (impls: {', '.join(e.impls)})")
    return 0


def _add_chips(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    c = sub.add_parser("chips", help="list the chip presets, or print one's YAML")
    c.add_argument("--show", metavar="NAME", help="print preset NAME's YAML (copy and edit it)")
    c.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="with --show: print the YAML with these overrides applied",
    )
    return c


def _run_chips(args: argparse.Namespace) -> int:
    from hwmodel import list_presets, load_chip, preset_path, to_yaml, with_overrides
    from torch2step.errors import InputError

    if args.sets and not args.show:
        raise InputError("--set applies to a preset's YAML: add --show NAME")
    if args.show:
        try:
            if args.sets:
                print(to_yaml(with_overrides(load_chip(args.show), args.sets)), end="")
            else:
                print(preset_path(args.show).read_text(encoding="utf-8"), end="")
        except Exception as e:  # a ChipConfigError: one line with the preset names
            raise InputError(f"--show: {e}") from None
        return 0
    for name in list_presets():
        desc = load_chip(name).description
        print(f"{name:<12} {desc.splitlines()[0] if desc else ''}")
    return 0


Command = tuple[
    Callable[[argparse._SubParsersAction], argparse.ArgumentParser],
    Callable[[argparse.Namespace], int],
]


def _mpirun_command() -> Command:
    from torch2step.mpirun import add_parser, run_mpirun

    def add(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        add_parser(sub)
        return sub.choices["mpirun"]

    return add, lambda args: run_mpirun(args, build_parser())


def _compare_command() -> Command:
    from hwmodel import list_presets
    from models import LAYERS
    from torch2step.cli_compare import add_compare_parser, compare

    def add(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        add_compare_parser(sub, list_presets(), list(LAYERS))
        return sub.choices["compare"]

    return add, lambda args: compare(args, build_parser())


def _sweep_command() -> Command:
    from torch2step.sweep_cli import add_sweep, run_sweep

    return add_sweep, run_sweep


#: name -> (add its arguments, run it).  Add a subcommand by adding an entry.
COMMANDS: dict[str, Callable[[], Command]] = {
    "report": lambda: (_add_report, _run_report),
    "compare": _compare_command,
    "sweep": _sweep_command,
    "import-onnx": lambda: (_add_import_onnx, _run_import_onnx),
    "mpirun": _mpirun_command,
    "layers": lambda: (_add_layers, _run_layers),
    "chips": lambda: (_add_chips, _run_chips),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (its ``--help`` is the CLI's reference)."""
    p = _Parser(prog="torch2step", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, make in COMMANDS.items():
        add, run = make()
        sp = add(sub)
        _common(sp)
        sp.set_defaults(run=run)
        assert sp.prog.endswith(name)
    return p


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record is emitted (as logging's
    last-resort handler does), not the stream it was made with: a caller that swaps
    ``sys.stderr`` after a command ran (a test capturing output, a redirecting context) gets
    the later records, and a closed old stream is never written to."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    logger = logging.getLogger("torch2step")
    for h in list(logger.handlers):
        if getattr(h, "_torch2step_cli", False):
            logger.removeHandler(h)
    handler = _Stderr()
    handler._torch2step_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("[%(relativeCreated)8.0f ms] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


#: The collector's thresholds while a command runs (Python's default: ``(700, 10, 10)``).
_COMMAND_GC_THRESHOLD = (50_000, 20, 10)


@contextmanager
def _command_gc(process_exit: bool) -> Iterator[None]:
    """Collect garbage cycles less often while a command runs; when the command is the
    process (``process_exit``), skip the interpreter's collections at exit.

    A report allocates millions of small objects that live until it ends (the captured FX
    graph and its sympy sizes, the layer and STeP graphs, the plan): with the default
    young-generation threshold the cycle collector walks them some 1,600 times (about 2 s of
    a 20 s decoder report) and the interpreter's last collections at exit walk all of them
    again (another 1.5-2 s) only to free memory the operating system reclaims anyway.
    Neither changes a result; the peak memory measured the same."""
    old = gc.get_threshold()
    gc.set_threshold(*_COMMAND_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if process_exit:
            gc.freeze()  # what is left is freed with the process, not walked by the collector


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torch2step`` command (``argv`` None: the process's arguments,
    the command being the whole process)."""
    with _command_gc(process_exit=argv is None):
        try:
            return _main(argv)
        except BrokenPipeError:  # the reader stopped early (``| head``): no traceback
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit fails no more
            return 1


def _main(argv: Sequence[str] | None) -> int:
    from torch2step.errors import InputError, Torch2StepError

    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose, args.quiet)
    try:
        return args.run(args)
    except InputError as e:
        # every problem of the input at once (a chip file lists each bad field on its line)
        parser.exit(2, f"{parser.prog} {args.command}: error: {str(e).rstrip()}\n")
    except Torch2StepError as e:
        lines = str(e).splitlines() or [""]
        more = (
            f" ({len(lines) - 1} more lines with -v)" if len(lines) > 1 and not args.verbose else ""
        )
        print(f"torch2step: {type(e).__name__}: {lines[0]}{more}", file=sys.stderr)
        for line in lines[1:]:
            if args.verbose or line.strip().startswith("to make it fit"):
                print(f"torch2step: {line.strip()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
