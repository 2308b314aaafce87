"""``torch2step compare`` and the kernel-by-kernel branch of ``torch2step report``.

``compare --layer L --batch B`` runs the spatial execution of the layer (STeP on an SDA preset)
and the kernel-by-kernel execution (ELK schedule + per-core programs on an ICCA preset) and
prints them side by side; ``report --execution kernel`` prints the ELK plan and breakdown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hwmodel.chip import Chip
from torch2step.errors import InputError

__all__ = [
    "add_compare_parser",
    "kernel_config_report",
    "kernel_report",
    "compare",
    "kernel_layer_report",
    "refuse_spatial_flags",
    "add_plan_flag",
    "plan_options",
]


def add_compare_parser(sub: Any, chips: list[str], layers: list[str]) -> None:
    """Register the ``compare`` sub-command."""
    c = sub.add_parser("compare", help="spatial vs kernel-by-kernel execution of one layer")
    c.add_argument("--layer", required=True, choices=layers, help="a registered layer")
    c.add_argument(
        "--batch", type=int, default=32, help="tokens (MoE) or decode requests (GQA); default 32"
    )
    c.add_argument("--kv-len", type=int, default=2048, help="GQA: KV cache rows (default 2048)")
    from elk.designs import DESIGNS

    presets = ", ".join(chips)
    c.add_argument(
        "--spatial-chip",
        default="step-sda",
        help=f"preset ({presets}) or YAML file (default step-sda)",
    )
    c.add_argument(
        "--kernel-chip",
        default="ipu-hbm",
        help=f"preset ({presets}) or YAML file (default ipu-hbm)",
    )
    for side in ("spatial", "kernel"):
        c.add_argument(
            f"--{side}-set",
            dest=f"{side}_sets",
            action="append",
            default=[],
            metavar="FIELD=VALUE",
            help=f"override a field of the {side} chip (as report's --set)",
        )
    c.add_argument(
        "--design",
        choices=DESIGNS,
        default="elk_full",
        help="ELK design of the kernel execution (ELK §6.1; default elk_full)",
    )
    add_plan_flag(c)
    c.add_argument("--json", action="store_true", help="print one JSON object")


def add_plan_flag(p: argparse.ArgumentParser) -> None:
    """``--plan KEY=VALUE``: the search budget of the kernel execution's ELK plan."""
    from elk.plan import DEFAULT_SEARCH as d

    p.add_argument(
        "--plan",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"kernel execution: the ELK plan's search, window=N (preload numbers tried per "
        f"operator, ELK §4.2; default {d['window']}), beam=N ({d['beam']}), orders=N (preload "
        f"orders tried, ELK §4.4; {d['max_orders']}), window_data=1 (count the window in "
        "operators that preload data); smaller plans a long step faster and may find a slower "
        "plan",
    )


#: ``--plan`` keys -> compile options (elk.plan.PLAN_OPTIONS)
_PLAN_KEYS = {
    "window": "plan_window",
    "beam": "plan_beam",
    "orders": "plan_orders",
    "window_data": "plan_window_data",
}


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The compile options ``--plan`` gives (:func:`add_plan_flag`), checked by
    :func:`elk.plan.plan_search` (``window_data`` is written 0 or 1)."""
    from elk.errors import ElkError
    from elk.plan import plan_search

    out: dict[str, Any] = {}
    for text in getattr(args, "plan", None) or []:
        key, sep, raw = str(text).partition("=")
        name = _PLAN_KEYS.get(key.strip())
        if not sep or name is None:
            raise InputError(
                f"--plan {text!r}: write KEY=VALUE with KEY one of {', '.join(_PLAN_KEYS)}, "
                "e.g. --plan window=8"
            )
        try:
            value: Any = int(raw)
        except ValueError:
            raise InputError(f"--plan {text!r}: the value must be an integer") from None
        if name == "plan_window_data":
            if value not in (0, 1):
                raise InputError(f"--plan {text!r}: window_data is 0 or 1")
            value = bool(value)
        try:
            plan_search({name: value})
        except ElkError as exc:
            raise InputError(f"--plan {text!r}: {exc}") from None
        out[name] = value
    return out


def kernel_layer_report(
    layer: str,
    batch: int,
    chip: Chip,
    kv_len: int = 2048,
    design: str = "elk_full",
    dtype: str = "bf16",
    routing: Any = None,
    plan: dict[str, Any] | None = None,
) -> Any:
    """Plan and simulate registered ``layer`` kernel by kernel on ``chip`` (shapes only), in
    ``dtype``; ``routing``: a MoE layer's expert choices (``[batch, top_k]``), else the
    experts expected under uniform routing; ``plan``: the plan's search options
    (:data:`elk.plan.PLAN_OPTIONS`)."""
    from elk.plan import plan_model, plan_search
    from models import LAYERS
    from torch2step.kernel import simulate_schedule
    from torch2step.kernel.layers import registered_layer_ops

    if LAYERS[layer].kind == "decoder":  # a decoder layer: its config's decode step
        return _decoder_report(layer, batch, chip, kv_len, design, dtype, routing, plan)
    ops = registered_layer_ops(layer, batch, kv_len, dtype, routing)
    sched = plan_model(ops, chip, design, **plan_search(dict(plan or {})))
    return simulate_schedule(sched, chip, tokens=batch)


def _decoder_report(
    layer: str,
    batch: int,
    chip: Chip,
    kv_len: int,
    design: str,
    dtype: str | None,
    routing: Any = None,
    plan: dict[str, Any] | None = None,
) -> Any:
    """A registered decoder layer kernel by kernel: the one-layer decode step of its
    ``config.json`` (``torch2step.compile_config``; a MoE decoder's experts those ``routing``
    selects, else those expected under uniform routing), every request attending ``kv_len``
    rows."""
    import torch2step
    from models.registry import HF_CONFIGS, LAYERS

    prog = torch2step.compile_config(
        HF_CONFIGS / LAYERS[layer].config, batch=batch, past=kv_len, chip=chip,
        execution="kernel", design=design, dtype=dtype, **(plan or {}),
        **({} if routing is None else {"routing": routing}),
    )  # fmt: skip
    return prog.report(tokens=batch)


#: ``report`` flags of the spatial execution only: (attribute, flag, its default).
_SPATIAL_ONLY = (
    ("options", "--option", []),
    ("kv_trace", "--kv-trace", "auto"),
    ("tiny", "--tiny", False),
    ("impl", "--impl", None),
    ("out", "--out", None),
    ("trace_window", "--trace-window", None),
    ("trace_units", "--trace-units", None),
)


def refuse_spatial_flags(args: argparse.Namespace, chip: Chip) -> None:
    """A kernel-by-kernel ``report`` given flags only the spatial execution honours: an
    :class:`~torch2step.errors.InputError` naming them (they would be silently ignored)."""

    given = [
        flag for attr, flag, default in _SPATIAL_ONLY if getattr(args, attr, default) != default
    ]
    if given:
        raise InputError(
            f"{', '.join(given)}: options of the spatial execution; on {chip.name} the report "
            "runs kernel by kernel (full size, every request attending --kv-len rows): drop "
            "them, or add --execution spatial"
        )


def kernel_report(args: argparse.Namespace, chip: Chip) -> int:
    """``report --execution kernel``: the ELK schedule and its simulated breakdown."""
    from models import LAYERS

    refuse_spatial_flags(args, chip)

    kv = getattr(args, "kv_len", None) or 2048
    design = getattr(args, "design", "elk_full")
    dtype = getattr(args, "dtype", None) or "bf16"
    entry = LAYERS[args.layer]
    routing, notes = None, []
    if entry.routing_prefix is not None:  # routed as the spatial report routes
        arg = getattr(args, "routing_trace", None) or "auto"
        routing, notes = _moe_routing(entry, args.layer, args.batch, arg)
    rep = kernel_layer_report(
        args.layer, args.batch, chip, kv, design, dtype, routing, plan_options(args)
    )
    if args.json:
        head = {"layer": args.layer, "batch": args.batch, "dtype": dtype}
        if entry.attends_kv:
            head["kv_len"] = kv
        out = {**head, **rep.to_dict(), "notes": notes}
        print(json.dumps(out))
    else:
        print(rep.schedule)
        print(rep)
        for n in notes:
            print(f"note: {n}")
    return 0


def kernel_config_report(args: argparse.Namespace, chip: Chip) -> int:
    """``report --hf-config C [--layers N] --chip ipu-hbm``: the decode step of a config at
    full size with no weights, kernel by kernel (one plan over all layers, ELK §4.4)."""
    import torch2step

    refuse_spatial_flags(args, chip)
    if args.batch < 1:
        raise InputError(f"--batch {args.batch}: must be a positive integer")
    kv = args.kv_len or 2048
    t0 = time.perf_counter()
    prog = torch2step.compile_config(
        args.hf_config, batch=args.batch, past=kv, chip=chip, layers=args.layers,
        execution="kernel", design=getattr(args, "design", "elk_full"), dtype=args.dtype,
        **plan_options(args),
    )  # fmt: skip
    compile_s = time.perf_counter() - t0
    if args.layers is None:
        rep: Any = prog.report(tokens=args.batch)
    else:
        k = args.sim_layers
        rep = prog.report(sim_layers=None if k is None else min(k, args.layers), tokens=args.batch)
    head = {"hf_config": str(args.hf_config), "batch": args.batch, "kv_len": kv}
    if args.json:
        print(json.dumps({**head, "compile_s": round(compile_s, 3), **rep.to_dict()}))
    else:
        print(rep.schedule)
        print(rep)
        print(f"compile (config, operators; the plan is made by the report) {compile_s:.2f} s")
    return 0


def chip_figures(chip: Chip) -> dict[str, float]:
    """A chip's clock, HBM bandwidth (TB/s) and peak bf16 compute (TFLOP/s, all cores)."""
    hz = chip.clock_ghz * 1e9
    return {
        "clock_ghz": chip.clock_ghz,
        "hbm_tb_s": chip.hbm.bytes_per_cycle * hz / 1e12,
        "peak_tflop_s": chip.num_cores * chip.core.flops("bf16") * hz / 1e12,
    }


def _kernel_bound(s: Any) -> float:
    """Cycles an ELK schedule takes at least: its HBM bytes over the HBM bandwidth or its FLOPs
    over the worker cores' peak, whichever is more (the plan's own chip figures)."""
    c = s.costs
    hbm = sum(op.hbm_bytes for op in s.ops) / c.hbm_peak
    return max(hbm, sum(op.flops for op in s.ops) / (c.cores * c.flops))


def _moe_routing(
    entry: Any, layer: str, batch: int, arg: str = "auto", compared: bool = False
) -> tuple[Any, list[str]]:
    """The expert choices the spatial report of ``layer`` at ``batch`` simulates with
    ``--routing-trace arg`` and the kernel side's note (``compared``: beside that spatial
    report, in ``compare``); None (the experts expected under uniform routing) where that
    report uses the model's router."""
    from models import get_layer
    from torch2step.kernel.layers import active_experts
    from torch2step.named import _experts, _routing

    meta = get_layer(layer, batch=batch, device="meta").metadata
    routing, note = _routing(entry, meta, arg)
    experts, top_k = _experts(meta["config"])  # a MoE layer's or a decoder's HF config
    n = active_experts(experts, top_k, batch, routing)
    # a decoder's experts are timed by its config's graph, which notes this itself
    timed = (
        ""
        if entry.kind == "decoder"
        else "; grouped operators each timed at its busiest expert's rows, their weights "
        "preloaded once topk has chosen them (ELK §7 'Apply ELK to MoE')"
    )
    if routing is None:
        return None, [f"experts: {n} of {experts}, expected under uniform routing{timed}"]
    how = note.removeprefix("routing: ")
    side = ", as the spatial side routes" if compared else ""
    return routing, [f"experts: {n} of {experts} active{side} ({how}){timed}"]


def compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``compare``: both execution models of one layer, side by side."""
    from models import LAYERS
    from torch2step.config_jobs import started
    from torch2step.named import report_layer, resolve_chip

    t0 = time.perf_counter()
    if args.batch < 1:
        parser.error("argument --batch: must be a positive integer")
    schip = resolve_chip(args.spatial_chip, args.spatial_sets, "--spatial-chip/--spatial-set")
    kchip = resolve_chip(args.kernel_chip, args.kernel_sets, "--kernel-chip/--kernel-set")
    entry = LAYERS[args.layer]
    kv_len = args.kv_len if entry.attends_kv else None
    routing, knotes = None, []
    if entry.kind == "decoder":
        knotes = [f"the one-layer decode step of {entry.config}"]
    if entry.routing_prefix is not None:  # both executions route the batch alike: the
        routing, more = _moe_routing(entry, args.layer, args.batch, compared=True)
        knotes += more

    def spatial() -> tuple[Any, list[str]]:
        # the same layer as the kernel execution plans: the served dtype (bf16), every request
        # at --kv-len; a report of its own (weights on the meta device), picklable
        run = report_layer(args.layer, args.batch, schip, kv_len=kv_len, dtype="bf16")
        return run.report, run.notes

    if not args.quiet:
        print(f"[{time.perf_counter() - t0:6.1f}s] spatial on {schip.name}", file=sys.stderr)
    spatial_result = started(spatial)  # in a worker beside the kernel execution (2 CPUs)
    if not args.quiet:
        print(
            f"[{time.perf_counter() - t0:6.1f}s] kernel-by-kernel on {kchip.name}", file=sys.stderr
        )
    krep = kernel_layer_report(
        args.layer, args.batch, kchip, args.kv_len, args.design, routing=routing,
        plan=plan_options(args),
    )  # fmt: skip
    srep, snotes = spatial_result()
    kus = krep.cycles / (kchip.clock_ghz * 1e3)
    kbound = _kernel_bound(krep.schedule)
    rows = {
        "spatial": {
            "chip": schip.name,
            "cycles": srep.latency_cycles,
            "latency_us": srep.latency_s * 1e6,
            "bound_us": srep.roofline_cycles / (schip.clock_ghz * 1e3),
            "of_bound": srep.roofline_fraction,
            "sim_s": srep.simulation_s,
            **chip_figures(schip),
        },
        "kernel": {
            "chip": kchip.name,
            "cycles": krep.cycles,
            "latency_us": kus,
            "bound_us": kbound / (kchip.clock_ghz * 1e3),
            "of_bound": kbound / krep.cycles if krep.cycles else 0.0,
            "sim_s": krep.sim_seconds,
            "plan_s": krep.schedule.plan_seconds,
            "hbm_util": krep.hbm_util,
            "noc_util": krep.noc_util,
            **chip_figures(kchip),
        },
    }
    if args.json:
        head = {"layer": args.layer, "batch": args.batch, "dtype": "bf16", "kv_len": kv_len}
        print(json.dumps({**head, **rows, "spatial_notes": snotes, "kernel_notes": knotes}))
        return 0
    print(f"{args.layer}, batch {args.batch}, bf16: spatial vs kernel-by-kernel")
    for n in snotes:
        print(f"  spatial: {n}")
    for n in knotes:
        print(f"  kernel: {n}")
    w = max(10, *(len(r["chip"]) for r in rows.values()))
    print(
        f"{'':10} {'chip':{w}} {'cycles':>12} {'GHz':>5} {'latency us':>11} {'bound us':>9} "
        f"{'of bound':>8} {'HBM TB/s':>9} {'TFLOP/s':>8} {'sim s':>7}"
    )
    for k, r in rows.items():
        print(
            f"{k:10} {r['chip']:{w}} {r['cycles']:12,} {r['clock_ghz']:5.2f} "
            f"{r['latency_us']:11.1f} {r['bound_us']:9.1f} {r['of_bound']:8.1%} "
            f"{r['hbm_tb_s']:9.2f} {r['peak_tflop_s']:8.0f} {r['sim_s']:7.2f}"
        )
    s_, k_ = rows["spatial"], rows["kernel"]
    if abs(s_["hbm_tb_s"] / k_["hbm_tb_s"] - 1) > 0.05 or (
        abs(s_["peak_tflop_s"] / k_["peak_tflop_s"] - 1) > 0.05
    ):
        print(
            "  the two chips differ in HBM bandwidth or peak compute: compare each side's latency "
            "with its own bound (max of the bytes over the HBM bandwidth and the FLOPs over the "
            "peak), not the latencies alone; --spatial-set / --kernel-set change either chip"
        )
    print()
    print(krep)
    return 0
