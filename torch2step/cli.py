"""Command line: ``torch2step report|import-onnx|layers|chips``.

``torch2step report --layer qwen3-moe --batch 64 --chip step-sda`` builds the named layer with
the real model's sizes, compiles it, and simulates it with the real expert-routing or KV-length
trace (packaged in :mod:`models.traces`).  Bad arguments print one line naming the valid choices
and exit with status 2; errors of the pipeline print their message (no traceback) and exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _progress(quiet: bool, t0: float, message: str) -> None:
    if not quiet:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (its ``--help`` is the CLI's reference)."""
    from hwmodel import list_presets
    from models import LAYERS

    chips = list_presets()
    p = _Parser(prog="torch2step", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("report", help="latency report of a named layer on a chip")
    r.add_argument("--layer", required=True, choices=list(LAYERS), help="a registered layer")
    r.add_argument("--batch", type=int, default=64, help="tokens (MoE) or decode requests (GQA)")
    r.add_argument("--chip", default="step-sda", help=f"preset ({', '.join(chips)}) or YAML file")
    r.add_argument(
        "--routing-trace",
        default="auto",
        help="MoE: expert choices — a packaged trace name (e.g. qwen_b64), an .npz/.npy file, "
        "'auto' (the model's real trace for this batch) or 'router' (the layer's own router)",
    )
    r.add_argument(
        "--kv-trace",
        default="auto",
        help="GQA: per-request KV lengths — a packaged trace name or alias (e.g. b64/med), an "
        ".npy file, or 'auto' (the 'med' batch of the Azure trace for this batch size)",
    )
    r.add_argument("--tiny", action="store_true", help="use the layer's tiny test configuration")
    r.add_argument("--impl", default=None, help="the layer's spelling (see `torch2step layers`)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument("--out", type=Path, default=None, help="write report.json and trace.json here")
    r.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    r.add_argument(
        "--execution",
        choices=("auto", "spatial", "kernel"),
        default="auto",
        help="spatial (STeP) or kernel-by-kernel (ELK); auto: kernel on ICCA chips (ipu-hbm, mesh)",
    )

    from torch2step.cli_compare import add_compare_parser

    add_compare_parser(sub, chips, list(LAYERS))

    o = sub.add_parser("import-onnx", help="import an ONNX file, compile and report it")
    o.add_argument("file", type=Path)
    o.add_argument("--chip", default="step-sda", help=f"preset ({', '.join(chips)}) or YAML file")
    o.add_argument("--tokens", type=int, default=16, help="size given to dynamic dimensions")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--print", action="store_true", help="print the layer and STeP graphs")
    o.add_argument("--quiet", action="store_true", help="no progress messages on stderr")

    sub.add_parser("layers", help="list the registered layers")
    sub.add_parser("chips", help="list the chip presets")
    return p


def _resolve_chip(parser: argparse.ArgumentParser, name: str) -> Any:
    from hwmodel import ChipConfigError, list_presets, load_chip

    if name not in list_presets() and not Path(name).is_file():
        parser.error(
            f"argument --chip: invalid choice {name!r} (choose from {', '.join(list_presets())} or a YAML file)"
        )
    try:
        return load_chip(name)
    except ChipConfigError as e:
        parser.error(f"argument --chip: {e}")


def _routing(parser: argparse.ArgumentParser, arg: str, meta: dict[str, Any]) -> np.ndarray | None:
    """The expert choices ``(tokens, top_k)`` to simulate, or None for the router's own."""
    from models import traces

    tokens, cfg = meta["tokens"], meta["config"]
    if arg == "router":
        return None
    if arg == "auto":
        if meta.get("routing_trace"):
            arg = meta["routing_trace"]
        else:  # the first `tokens` tokens of the large batch of the same model
            prefix = "mixtral" if cfg.num_experts == 8 else "qwen"
            big = traces.routing(f"{prefix}_b1024")
            if tokens > len(big) or big.max() >= cfg.num_experts or big.shape[1] != cfg.top_k:
                return None
            return big[:tokens]
    try:
        sel = traces.routing(arg)
    except (KeyError, OSError, ValueError) as e:
        names = ", ".join(traces.list_traces()["routing"])
        parser.error(f"argument --routing-trace: {e} (packaged traces: {names})")
    if sel.shape[0] < tokens or sel.shape[1] != cfg.top_k or sel.max() >= cfg.num_experts:
        parser.error(
            f"argument --routing-trace: {arg} has shape {sel.shape} with experts < {sel.max() + 1}; "
            f"the layer needs >= {tokens} tokens, top-{cfg.top_k} of {cfg.num_experts} experts"
        )
    return sel[:tokens]


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch2step
    from models import LAYERS, get_layer, traces

    t0 = time.perf_counter()
    chip = _resolve_chip(parser, args.chip)
    if args.batch < 1:
        parser.error("argument --batch: must be a positive integer")
    entry = LAYERS[args.layer]
    from torch2step.kernel.layers import ICCA_CHIPS

    if args.execution == "kernel" or (args.execution == "auto" and chip.name in ICCA_CHIPS):
        from torch2step.cli_compare import kernel_report

        return kernel_report(args, chip)
    if args.impl is not None and args.impl not in entry.impls:
        parser.error(
            f"argument --impl: invalid choice {args.impl!r} (choose from {', '.join(entry.impls)})"
        )
    kv: Any = None
    if entry.kind == "attention":
        kv = args.kv_trace
        if kv == "auto":
            alias = f"b{args.batch}/med"
            kv = alias if alias in traces.kv_aliases() else None
        if kv is not None:
            try:
                lens = traces.kv_lengths(kv)
            except (KeyError, OSError, ValueError) as e:
                parser.error(
                    f"argument --kv-trace: {e} (aliases: {', '.join(traces.kv_aliases())})"
                )
            if len(lens) != args.batch:
                parser.error(
                    f"argument --kv-trace: {kv} holds {len(lens)} requests, --batch is {args.batch}"
                )
            if args.tiny:
                lens = np.minimum(lens, 64)
            kv = lens
    _progress(
        args.quiet, t0, f"building {args.layer} (batch {args.batch}{', tiny' if args.tiny else ''})"
    )
    spec = get_layer(
        args.layer, tiny=args.tiny, batch=args.batch, kv_lengths=kv, impl=args.impl, device="cpu"
    )
    routing = _routing(parser, args.routing_trace, spec.metadata) if entry.kind == "moe" else None
    _progress(args.quiet, t0, f"compiling for {chip.name}")
    prog = torch2step.compile(
        spec.module, spec.example_inputs, chip=chip, dynamic_shapes=spec.dynamic_shapes
    )
    _progress(args.quiet, t0, "simulating")
    rep = prog.report(*spec.example_inputs, routing=routing, trace=bool(args.out))
    _progress(args.quiet, t0, f"done: {rep.latency_cycles:,} cycles")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rep.to_json(args.out / "report.json")
        prog.write_trace(args.out / "trace.json")
    print(rep.to_json() if args.json else rep)
    return 0


def _import_onnx(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch2step

    t0 = time.perf_counter()
    chip = _resolve_chip(parser, args.chip)
    _progress(args.quiet, t0, f"importing {args.file}")
    graph = torch2step.import_onnx(args.file)
    inputs = torch2step.example_inputs_for(graph, size=args.tokens)
    _progress(args.quiet, t0, f"compiling for {chip.name}")
    prog = torch2step.compile(graph, inputs, chip=chip)
    if args.print:
        prog.print()
    _progress(args.quiet, t0, "simulating")
    rep = prog.report(*inputs)
    print(rep.to_json() if args.json else rep)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torch2step`` command."""
    from torch2step.errors import Torch2StepError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "layers":
        from models import LAYERS

        for name, e in LAYERS.items():
            print(f"{name:<12} {e.description}  (impls: {', '.join(e.impls)})")
        return 0
    if args.command == "chips":
        from hwmodel import list_presets, load_chip

        for name in list_presets():
            print(
                f"{name:<12} {load_chip(name).description.splitlines()[0] if load_chip(name).description else ''}"
            )
        return 0
    try:
        if args.command == "compare":
            from torch2step.cli_compare import compare

            return compare(args, parser)
        return _report(args, parser) if args.command == "report" else _import_onnx(args, parser)
    except Torch2StepError as e:
        print(f"torch2step: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
