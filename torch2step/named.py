"""Report of a registered layer (``models.LAYERS``) with its real traces: the pipeline behind
``torch2step report`` and each point of ``torch2step sweep``.

Every input the user did not give explicitly is chosen here and *said*: the choice goes into
the report's ``notes`` and ``options`` (which routing trace, or the model's router and why; how
a KV-length trace was scaled for ``--tiny``).  Bad inputs raise :class:`InputError` naming the
argument, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from hwmodel import Chip, ChipConfigError, load_chip, with_overrides
from torch2step.errors import InputError
from torch2step.fit import fit_suggestions, report_fitting

__all__ = [
    "LayerRun",
    "resolve_chip",
    "parse_options",
    "report_layer",
    "report_config",
    "fit_suggestions",
]

log = logging.getLogger("torch2step")


#: Seconds between the progress log lines of a report whose stderr is a file or pipe.
LOG_EVERY_S = 10.0


@contextmanager
def simulation_progress() -> Iterator[None]:
    """While the ``torch2step`` logger is at INFO: the simulated cycles of the run under way
    (:func:`runtime.engine.progress`; a report may run the simulator more than once, e.g. to
    deepen FIFOs) — on a terminal a tqdm bar on stderr redrawn every half second, into a file
    or pipe one log line every 10 s (a bar's carriage returns would garble a log).  Nothing at
    all otherwise."""
    if not log.isEnabledFor(logging.INFO):
        yield
        return
    from runtime.engine import progress

    if not getattr(sys.stderr, "isatty", lambda: False)():
        last = [time.monotonic() if LOG_EVERY_S > 0 else float("-inf")]

        def line(cycle: int, events: int) -> None:
            now = time.monotonic()
            if now - last[0] >= LOG_EVERY_S:
                last[0] = now
                log.info("simulating: %s cycles, %s events so far", f"{cycle:,}", f"{events:,}")

        with progress(line):
            yield
        return
    from tqdm import tqdm

    bar = tqdm(
        desc="simulating",
        unit=" cycles",
        unit_scale=True,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    last = [float("-inf")]

    def update(cycle: int, events: int) -> None:
        bar.n = cycle
        bar.set_postfix_str(f"{events:,} events", refresh=False)
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            bar.refresh()

    try:
        with progress(update):
            yield
    finally:
        bar.close()


#: Compiled programs of the last few (layer, config, chip, options): the program is symbolic in
#: the batch (tokens / requests / KV lengths are data or dynamic sizes), and the registered
#: layers' weights depend only on their seed, so the points of a sweep that differ only in
#: batch or trace share one compilation.
_COMPILED: OrderedDict[str, Any] = OrderedDict()
_COMPILED_MAX = 2


def _compiled(key: dict[str, Any], spec: Any, chip: Chip, opts: dict[str, Any]) -> Any:
    import torch2step
    from hwmodel import to_dict
    from torch2step.errors import FrontendError

    k = json.dumps({**key, "chip": to_dict(chip), "options": opts}, sort_keys=True, default=str)
    prog = _COMPILED.get(k)
    if prog is not None:
        try:
            prog._check(spec.example_inputs)
        except FrontendError:
            prog = None
    if prog is None:
        log.info("compiling for %s", chip.name)
        prog = torch2step.compile(
            spec.module,
            spec.example_inputs,
            chip=chip,
            dynamic_shapes=spec.dynamic_shapes,
            execution="spatial",
            **opts,
        )
    else:
        log.info("reusing the program compiled for %s", chip.name)
    _COMPILED[k] = prog
    _COMPILED.move_to_end(k)
    while len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return prog


@dataclass
class LayerRun:
    """What :func:`report_layer` returns: the report, the compiled program, the notes."""

    report: Any
    program: Any
    notes: list[str] = field(default_factory=list)


def resolve_chip(chip: str | Chip, sets: Sequence[str] = (), flags: str = "--chip/--set") -> Chip:
    """A preset name or YAML path (or a :class:`Chip`) with ``FIELD=VALUE`` overrides; a
    problem is an :class:`InputError` naming the ``flags`` that gave them."""
    try:
        return with_overrides(load_chip(chip), sets)
    except ChipConfigError as e:
        raise InputError(f"{flags}: {e}") from None


#: The string options of a spatial compile and the values each takes (``LowerOptions``
#: checks the lowering's; ``torch2step.compile`` the strategy search's).
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "moe_lane_assign": ("dispatch", "consecutive"),
    "attn_assign": ("coarse", "interleave", "dynamic"),
    "strategy": ("auto", "default"),
}

#: The options of a spatial compile that are not tiling options (``LowerOptions``): the STeP
#: §5 strategy search of ``torch2step.compile`` and its budgets, with their kinds.
STRATEGY_OPTIONS: dict[str, str] = {
    "strategy": "str | None",
    "onchip_budget": "int | None",
    "compute_budget": "int | None",
}

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def option_kinds() -> dict[str, str]:
    """Every option a spatial ``torch2step.compile`` takes -> its declared type (``int``,
    ``float``, ``str``, ``bool``, each optionally ``| None``): the tiling options of
    :class:`~torch2step.lower.LowerOptions`, then :data:`STRATEGY_OPTIONS`."""
    from torch2step.lower import LowerOptions

    kinds = {f.name: str(f.type) for f in dataclasses.fields(LowerOptions)}
    return {**kinds, **STRATEGY_OPTIONS}


def _allowed(key: str, kind: str) -> str:
    """The values option ``key`` of ``kind`` takes, in words."""
    base = kind.removesuffix(" | None")
    if base == "str":
        what = "one of " + ", ".join(OPTION_CHOICES.get(key, ()))
    else:
        what = {"int": "an integer", "float": "a number", "bool": "true or false"}[base]
    return what + (" or none" if kind.endswith("| None") else "")


def _option_value(key: str, kind: str, value: Any, text: bool) -> Any:
    """``value`` of option ``key`` checked against its ``kind`` (``text``: as written after
    ``--option KEY=``, parsed by the kind); a bad value is an :class:`InputError` naming the
    option, the value and the values allowed."""
    nullable = kind.endswith("| None")
    base = kind.removesuffix(" | None")
    bad = InputError(f"--option {key}={value!r}: must be {_allowed(key, kind)}")
    if text:
        raw = str(value).strip()
        if raw.lower() == "none":
            value = None
        elif base == "int":
            try:
                value = int(raw)
            except ValueError:
                raise bad from None
        elif base == "float":
            try:
                value = float(raw)
            except ValueError:
                raise bad from None
        elif base == "bool":
            if raw.lower() not in _TRUE + _FALSE:
                raise bad
            value = raw.lower() in _TRUE
        else:
            value = raw
    if value is None:
        if not nullable:
            raise bad
        return None
    if base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base == "bool":
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, str) and value in OPTION_CHOICES.get(key, (value,))
    if not ok:
        raise bad
    return value


def parse_options(items: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Options of a spatial compile (:func:`option_kinds`) from ``["moe_lanes=4", ...]`` (each
    value parsed by its option's type: an integer, a number, ``true``/``false``, one of a
    string option's :data:`OPTION_CHOICES`, or ``none`` where the option may be None) or from
    a mapping of typed values (a sweep spec's); an unknown option or a bad value is an
    :class:`InputError` naming it, the value and what is allowed."""
    kinds = option_kinds()
    text = not isinstance(items, Mapping)
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            key, sep, raw = str(item).partition("=")
            if not sep:
                raise InputError(f"--option {item!r}: write KEY=VALUE, e.g. moe_lanes=4")
            pairs.append((key.strip(), raw))
    out = {}
    for key, value in pairs:
        if key not in kinds:
            close = difflib.get_close_matches(str(key), list(kinds), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise InputError(
                f"--option {key}: unknown compile option{hint}; valid options: {', '.join(kinds)}"
            )
        out[key] = _option_value(key, kinds[key], value, text)
    return out


def _check_id_dtype(arg: str) -> None:
    """A routing file must hold integer expert ids (a float array would be truncated)."""
    from pathlib import Path

    path = Path(arg)
    if path.suffix not in (".npz", ".npy") or not path.is_file():
        return
    try:
        if path.suffix == ".npz":
            with np.load(path) as z:
                dtype = z[z.files[0] if "data" not in z.files else "data"].dtype
        else:
            dtype = np.load(path, mmap_mode="r").dtype
    except (OSError, ValueError, IndexError) as e:
        raise InputError(f"--routing-trace {arg}: cannot read it: {e}") from None
    if not np.issubdtype(dtype, np.integer):
        raise InputError(
            f"--routing-trace {arg}: expert ids must be integers, the file holds {dtype} "
            "(ids are never rounded or truncated)"
        )


def _experts(config: Any) -> tuple[int, int]:
    """``(experts, top_k)`` of a MoE config: the project's ``MoEConfig`` or a HuggingFace
    config (``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``)."""
    if hasattr(config, "top_k"):
        return config.num_experts, config.top_k
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return int(experts), int(config.num_experts_per_tok)


def _misfit(sel: np.ndarray, tokens: int, cfg: Any) -> str | None:
    """Why packaged expert choices ``sel`` cannot route ``tokens`` tokens of a layer with
    ``cfg.top_k`` of ``cfg.num_experts`` experts (None: they can)."""
    if len(sel) < tokens:
        return f"has {len(sel)} tokens, the batch is {tokens}"
    if sel.max() >= cfg.num_experts or sel.shape[1] != cfg.top_k:
        return (
            f"routes top-{sel.shape[1]} of {sel.max() + 1}+ experts; this layer has "
            f"top-{cfg.top_k} of {cfg.num_experts}"
        )
    return None


def _routing(entry: Any, meta: dict[str, Any], arg: str) -> tuple[np.ndarray | None, str]:
    """Expert choices ``(tokens, top_k)`` to simulate (None: the router's own) and a note."""
    from models import traces

    tokens = meta["tokens"]
    num_experts, top_k = _experts(meta["config"])
    cfg = SimpleNamespace(num_experts=num_experts, top_k=top_k)
    if arg == "router":
        if entry.kind == "decoder" and meta.get("device") == "meta":
            return None, (
                "routing: the model's router (--routing-trace router), on stand-in values: the "
                "layer is shapes only, so its router weighs random stand-in weights"
            )
        return None, "routing: the model's router (--routing-trace router)"
    if arg == "auto":  # the layer's trace for this batch, else the model's largest one
        names = [n for n in (meta.get("routing_trace"), f"{entry.routing_prefix}_b1024") if n]
        why = []
        for name in dict.fromkeys(names):
            sel = np.asarray(traces.routing(name))
            misfit = _misfit(sel, tokens, cfg)
            if misfit is None:
                return sel[:tokens], f"routing: the first {tokens} tokens of trace {name}"
            why.append(f"{name} {misfit}")
        return None, f"routing: the model's router (no packaged trace fits: {'; '.join(why)})"
    _check_id_dtype(arg)
    try:
        sel = np.asarray(traces.routing(arg))
    except (KeyError, OSError, ValueError) as e:
        names = ", ".join(traces.list_traces()["routing"])
        raise InputError(f"--routing-trace: {e} (packaged traces: {names})") from None
    if sel.ndim != 2 or not np.issubdtype(sel.dtype, np.integer):
        raise InputError(
            f"--routing-trace {arg}: expected integer expert ids of shape (tokens, top_k); got "
            f"{sel.dtype} of shape {sel.shape}"
        )
    if sel.shape[0] < tokens or sel.shape[1] != cfg.top_k or sel.min() < 0:
        raise InputError(
            f"--routing-trace {arg}: shape {sel.shape}, ids {sel.min()}..{sel.max()}; the layer "
            f"needs >= {tokens} tokens, top-{cfg.top_k} of experts 0..{cfg.num_experts - 1}"
        )
    if sel.max() >= cfg.num_experts:
        raise InputError(
            f"--routing-trace {arg}: expert id {sel.max()} but the layer has {cfg.num_experts} "
            "experts (use --routing-trace router, or a trace of this model)"
        )
    return sel[:tokens], f"routing: trace {arg} (first {tokens} of {sel.shape[0]} tokens)"


def _kv(arg: str, batch: int, tiny: bool) -> tuple[np.ndarray | None, str]:
    """Per-request KV lengths (None: the layer's default) and a note."""
    from models import traces

    if arg == "auto":
        alias = f"b{batch}/med"
        if alias not in traces.kv_aliases():
            return None, f"KV lengths: the layer's default (no packaged trace for batch {batch})"
        arg = alias
    try:
        lens = np.asarray(traces.kv_lengths(arg))
    except (KeyError, OSError, ValueError) as e:
        raise InputError(f"--kv-trace: {e} (aliases: {', '.join(traces.kv_aliases())})") from None
    if lens.ndim != 1 or not np.issubdtype(lens.dtype, np.integer) or (lens < 1).any():
        raise InputError(f"--kv-trace {arg}: KV lengths must be positive integers, one per request")
    if len(lens) != batch:
        raise InputError(f"--kv-trace {arg}: holds {len(lens)} requests, --batch is {batch}")
    note = f"KV lengths: trace {arg}"
    if tiny and lens.max() > 64:
        scaled = np.maximum(1, np.rint(lens * (64.0 / lens.max()))).astype(np.int64)
        note += f" scaled by 64/{lens.max()} for --tiny (max 64, shape kept)"
        lens = scaled
    return lens, note


def report_layer(
    layer: str,
    batch: int,
    chip: str | Chip = "step-sda",
    *,
    sets: Sequence[str] = (),
    options: Mapping[str, Any] | Sequence[str] = (),
    routing_trace: str = "auto",
    kv_trace: str = "auto",
    tiny: bool = False,
    impl: str | None = None,
    trace: bool = False,
    reuse: bool = True,
    dtype: str = "bf16",
    kv_len: int | None = None,
) -> LayerRun:
    """Build, compile and simulate the registered ``layer`` at ``batch`` (module docstring)
    in the spatial (STeP) execution, on any chip (the kernel-by-kernel report of a registered
    layer is :func:`torch2step.cli_compare.kernel_layer_report`);
    ``reuse``: take the program compiled for an earlier batch of the same layer, chip and
    options when its inputs' static sizes match.  ``dtype``: the element type the layer is
    built, timed and its bytes counted in (``bf16`` as served and as the STeP paper's
    evaluation uses, or ``fp32``).  ``kv_len``: attention and decoder layers: every request
    attends ``kv_len`` cached rows (a uniform batch, as the kernel-by-kernel operator lists
    assume) instead of the KV lengths of ``kv_trace``."""
    import torch

    from models import LAYERS, get_layer

    if layer not in LAYERS:
        close = difflib.get_close_matches(layer, list(LAYERS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"--layer {layer!r}: unknown layer{hint}; layers: {', '.join(LAYERS)}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InputError(f"--batch {batch!r}: must be a positive integer")
    entry = LAYERS[layer]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if dtype not in dtypes:
        raise InputError(f"--dtype {dtype!r}: choose from {', '.join(dtypes)}")
    if impl is not None and impl not in entry.impls:
        raise InputError(f"--impl {impl!r}: choose from {', '.join(entry.impls)}")
    opts = parse_options(options)
    target = resolve_chip(chip, sets)
    notes: list[str] = []
    kv = None
    if entry.attends_kv and kv_len is not None:
        if not isinstance(kv_len, int) or isinstance(kv_len, bool) or kv_len < 1:
            raise InputError(f"--kv-len {kv_len!r}: must be a positive integer")
        if kv_trace != "auto":
            raise InputError(
                f"--kv-len {kv_len} and --kv-trace {kv_trace}: give one (a uniform KV length "
                "or one per request)"
            )
        notes.append(f"KV lengths: every request {kv_len} (uniform)")
    elif entry.attends_kv:
        kv, note = _kv(kv_trace, batch, tiny)
        notes.append(note)
    else:
        kv_len = None  # no KV cache
    log.info("building %s (batch %d%s)", layer, batch, ", tiny" if tiny else "")
    # a full-size layer is built on the meta device (shapes only) and timed on stand-in
    # values: a timing report reads no weight or cache value, only what steers control (the
    # KV lengths and the routing trace are real inputs); the layer's own router needs weights
    own_router = entry.kind == "moe" and routing_trace == "router"
    device = "meta" if not tiny and not own_router else "cpu"
    spec = get_layer(
        layer,
        tiny=tiny,
        batch=batch,
        kv_len=kv_len,
        kv_lengths=kv,
        impl=impl,
        device=device,
        dtype=dtypes[dtype],
    )
    timed = tuple(spec.example_inputs)
    lens = spec.metadata.get("kv_lengths")
    if device == "meta" and lens is not None:  # the KV lengths steer the run: real values
        timed = tuple(
            torch.as_tensor(np.asarray(lens), dtype=x.dtype)
            if x.is_meta and not x.dtype.is_floating_point and tuple(x.shape) == (len(lens),)
            else x
            for x in timed
        )
    routing = None
    if entry.routing_prefix is not None:  # a MoE layer, or a decoder layer with experts
        routing, note = _routing(entry, spec.metadata, routing_trace)
        notes.append(note)
    for n in notes:
        log.info("%s", n)
    key = {
        "layer": layer,
        "tiny": tiny,
        "impl": impl,
        "dtype": dtype,
        "seed": spec.metadata.get("seed"),
    }

    def make(o: dict[str, Any]) -> Any:
        if reuse:
            return _compiled(key, spec, target, o)
        import torch2step

        log.info("compiling for %s", target.name)
        return torch2step.compile(
            spec.module,
            spec.example_inputs,
            chip=target,
            dynamic_shapes=spec.dynamic_shapes,
            execution="spatial",
            **o,
        )

    def run(prog: Any, said: list[str]) -> Any:
        log.info("simulating")
        with simulation_progress():
            return prog.report(*timed, routing=routing, trace=trace, notes=said)

    prog, rep, opts = report_fitting(make, run, entry.kind, opts, notes, target.name)
    rep = replace(
        rep, options={**rep.options, "layer": layer, "batch": batch, "tiny": tiny, **opts}
    )
    log.info("done: %s cycles", f"{rep.latency_cycles:,}")
    return LayerRun(rep, prog, notes)


def report_config(
    config: Any,
    batch: int,
    chip: str | Chip = "step-sda",
    *,
    sets: Sequence[str] = (),
    options: Mapping[str, Any] | Sequence[str] = (),
    trace: bool = False,
    layers: int | None = None,
    dtype: str | None = None,
    routing_trace: str = "auto",
) -> LayerRun:
    """Compile and simulate layer 0 of a HuggingFace ``config.json`` (or ``layers`` identical
    layers) as a decode step at full size with no weights (:func:`torch2step.compile_config`),
    in the spatial (STeP) execution,
    in ``dtype`` (default: the dtype the config says the model is served in).
    ``routing_trace``: a MoE layer's expert choices, a packaged trace name or a file (``auto``
    and ``router``: the router's own choice, on stand-in values; the report's note says so)."""
    import torch2step
    from torch2step.layers import ops as L

    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InputError(f"--batch {batch!r}: must be a positive integer")
    opts = parse_options(options)
    target = resolve_chip(chip, sets)
    log.info("compiling %s (batch %d, no weights) for %s", config, batch, target.name)

    def make(o: dict[str, Any]) -> Any:
        return torch2step.compile_config(
            config, batch=batch, chip=target, layers=layers, dtype=dtype, execution="spatial", **o
        )

    prog = make(opts)
    layer = prog.body.layer if hasattr(prog, "body") else prog.layer  # a stack: its layer
    routers = list(layer.ops(L.TopKRouting))
    experts = [n.op.num_experts for n in layer.ops(L.MoEExperts)]
    routing, notes = None, []
    if routers and experts:
        if routing_trace in ("auto", "router"):
            notes.append(
                "routing: the model's router on stand-in values (a config has no weights, so "
                "the router weighs random stand-in weights and its choice is random)"
                + (
                    "; --routing-trace NAME|FILE routes by a trace"
                    if routing_trace == "auto"
                    else ""
                )
            )
        else:
            moe = SimpleNamespace(num_experts=experts[0], top_k=routers[0].op.k)
            entry = SimpleNamespace(kind="decoder", routing_prefix=None)
            routing, note = _routing(entry, {"tokens": batch, "config": moe}, routing_trace)
            notes.append(note)
    elif routing_trace != "auto":
        raise InputError(f"--routing-trace {routing_trace}: the model has no MoE router")
    for n in notes:
        log.info("%s", n)

    def run(p: Any, said: list[str]) -> Any:
        log.info("simulating")
        with simulation_progress():
            return p.report(trace=trace, routing=routing, notes=said)

    prog, rep, opts = report_fitting(
        lambda o: prog if o == opts else make(o), run, "decoder", opts, notes, target.name
    )
    rep = replace(rep, options={**rep.options, "hf_config": str(config), "batch": batch, **opts})
    log.info("done: %s cycles", f"{rep.latency_cycles:,}")
    return LayerRun(rep, prog, notes)
