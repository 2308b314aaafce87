"""Validation of chip descriptions: every field checked, every problem named by its dotted path.

``validate(chip)`` is called by :func:`hwmodel.load_chip` and may be called on hand-built chips.
It collects all problems and raises one :class:`ChipConfigError` listing them, each naming the
field (``noc.link_bytes_per_cycle``), the value found and what is allowed.
"""

from __future__ import annotations

import math

from hwmodel.chip import AllToAllNoC, Chip, CoreSpec, HbmSpec, MeshNoC
from hwmodel.errors import ChipConfigError

__all__ = ["validate", "chip_problems"]

_ROUTINGS = ("xy", "yx")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))  # type: ignore[arg-type]
    )


def _int(problems: list[str], path: str, value: object, minimum: int, what: str) -> None:
    """An integer ``>= minimum``; ``what`` is the unit phrase used in the message."""
    if not _is_int(value):
        problems.append(
            f"{path} = {value!r}: must be an integer {what} (got {type(value).__name__})"
        )
    elif value < minimum:  # type: ignore[operator]
        bound = "positive" if minimum == 1 else f">= {minimum}"
        problems.append(f"{path} = {value!r}: must be a {bound} integer {what}")


def _positive_num(problems: list[str], path: str, value: object, what: str) -> None:
    if not _is_num(value):
        problems.append(f"{path} = {value!r}: must be a positive number {what}")
    elif value <= 0:  # type: ignore[operator]
        problems.append(f"{path} = {value!r}: must be a positive number {what}")


def _core_problems(core: object, problems: list[str]) -> None:
    if not isinstance(core, CoreSpec):
        problems.append(f"core: must be a CoreSpec, got {type(core).__name__}")
        return
    fpc = core.flops_per_cycle
    if not isinstance(fpc, tuple) or not fpc:
        problems.append(
            "core.flops_per_cycle: must be a non-empty mapping dtype -> FLOPs per cycle "
            "(e.g. {bf16: 2048})"
        )
    else:
        seen: set[str] = set()
        for entry in fpc:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                problems.append(
                    f"core.flops_per_cycle: entry {entry!r} must be a (dtype, FLOPs per cycle) pair"
                )
                continue
            name, value = entry
            if not isinstance(name, str) or not name:
                problems.append(
                    f"core.flops_per_cycle: dtype name {name!r} must be a non-empty string"
                )
                continue
            if name in seen:
                problems.append(f"core.flops_per_cycle.{name}: listed twice; give each dtype once")
            seen.add(name)
            _int(problems, f"core.flops_per_cycle.{name}", value, 1, "number of FLOPs per cycle")
    _int(problems, "core.sram_bytes", core.sram_bytes, 1, "number of bytes")
    _int(
        problems,
        "core.sram_bytes_per_cycle",
        core.sram_bytes_per_cycle,
        1,
        "number of bytes per cycle",
    )
    _int(problems, "core.fifo_depth", core.fifo_depth, 1, "number of FIFO entries")
    _int(
        problems,
        "core.kernel_launch_cycles",
        core.kernel_launch_cycles,
        0,
        "number of cycles",
    )


def _hbm_problems(hbm: object, num_cores: object, problems: list[str]) -> None:
    if not isinstance(hbm, HbmSpec):
        problems.append(f"hbm: must be an HbmSpec, got {type(hbm).__name__}")
        return
    _int(problems, "hbm.channels", hbm.channels, 1, "number of channels")
    _positive_num(
        problems,
        "hbm.bytes_per_cycle_per_channel",
        hbm.bytes_per_cycle_per_channel,
        "of bytes per cycle",
    )
    _int(problems, "hbm.latency_cycles", hbm.latency_cycles, 0, "number of cycles")
    _int(problems, "hbm.capacity_bytes", hbm.capacity_bytes, 1, "number of bytes")
    _int(problems, "hbm.interleave_bytes", hbm.interleave_bytes, 1, "number of bytes")
    attach = hbm.attach_cores
    if not isinstance(attach, tuple):
        problems.append(
            f"hbm.attach_cores: must be a list of core ids, got {type(attach).__name__}"
        )
        return
    if attach and _is_int(hbm.channels) and len(attach) != hbm.channels:
        problems.append(
            f"hbm.attach_cores: lists {len(attach)} cores but hbm.channels = {hbm.channels}; "
            "give one core per channel, or an empty list for uniform access"
        )
    for n, core in enumerate(attach):
        if not _is_int(core):
            problems.append(f"hbm.attach_cores[{n}] = {core!r}: must be an integer core id")
        elif _is_int(num_cores) and not 0 <= core < num_cores:  # type: ignore[operator]
            problems.append(
                f"hbm.attach_cores[{n}] = {core}: must be a core id in 0..{num_cores - 1}"  # type: ignore[operator]
            )


def _noc_problems(noc: object, num_cores: object, problems: list[str]) -> None:
    if isinstance(noc, MeshNoC):
        _int(problems, "noc.rows", noc.rows, 1, "number of mesh rows")
        _int(problems, "noc.cols", noc.cols, 1, "number of mesh columns")
        if (
            _is_int(noc.rows)
            and _is_int(noc.cols)
            and _is_int(num_cores)
            and noc.rows * noc.cols != num_cores
        ):
            problems.append(
                f"noc.rows x noc.cols = {noc.rows} x {noc.cols} = {noc.rows * noc.cols} must "
                f"equal num_cores = {num_cores} (one core per mesh router)"
            )
        _positive_num(
            problems, "noc.link_bytes_per_cycle", noc.link_bytes_per_cycle, "of bytes per cycle"
        )
        _int(problems, "noc.hop_latency_cycles", noc.hop_latency_cycles, 0, "number of cycles")
        if noc.routing not in _ROUTINGS:
            problems.append(
                f"noc.routing = {noc.routing!r}: must be one of {', '.join(_ROUTINGS)} "
                "(dimension-order routing)"
            )
        if noc.kind != "mesh":
            problems.append(f"noc.kind = {noc.kind!r}: a MeshNoC has kind 'mesh'")
    elif isinstance(noc, AllToAllNoC):
        _positive_num(
            problems,
            "noc.injection_bytes_per_cycle",
            noc.injection_bytes_per_cycle,
            "of bytes per cycle",
        )
        _positive_num(
            problems,
            "noc.ejection_bytes_per_cycle",
            noc.ejection_bytes_per_cycle,
            "of bytes per cycle",
        )
        _int(problems, "noc.latency_cycles", noc.latency_cycles, 0, "number of cycles")
        if noc.kind != "all_to_all":
            problems.append(f"noc.kind = {noc.kind!r}: an AllToAllNoC has kind 'all_to_all'")
    else:
        problems.append(
            f"noc: must be a MeshNoC (kind: mesh) or an AllToAllNoC (kind: all_to_all), "
            f"got {type(noc).__name__}"
        )


def chip_problems(chip: Chip) -> list[str]:
    """Every problem of ``chip`` as ``"<dotted.field> = <value>: <what is allowed>"`` lines."""
    problems: list[str] = []
    if not isinstance(chip.name, str) or not chip.name:
        problems.append(f"name = {chip.name!r}: must be a non-empty string")
    _positive_num(problems, "clock_ghz", chip.clock_ghz, "of GHz")
    _int(problems, "num_cores", chip.num_cores, 1, "number of cores")
    _core_problems(chip.core, problems)
    _hbm_problems(chip.hbm, chip.num_cores, problems)
    _noc_problems(chip.noc, chip.num_cores, problems)
    if chip.execution not in ("spatial", "kernel"):
        problems.append(
            f"execution = {chip.execution!r}: must be 'spatial' (a dataflow accelerator) or "
            "'kernel' (an inter-core-connected chip, run operator by operator)"
        )
    if not isinstance(chip.description, str):
        problems.append(f"description: must be a string, got {type(chip.description).__name__}")
    if not isinstance(chip.sources, tuple) or not all(isinstance(s, str) for s in chip.sources):
        problems.append("sources: must be a list of strings (citations)")
    return problems


def validate(chip: Chip) -> Chip:
    """Check every field of ``chip``; return it unchanged or raise :class:`ChipConfigError`
    listing each invalid field by dotted path with what is allowed."""
    if not isinstance(chip, Chip):
        raise ChipConfigError(f"expected a hwmodel.Chip, got {type(chip).__name__}")
    problems = chip_problems(chip)
    if problems:
        name = chip.name if isinstance(chip.name, str) else "?"
        if len(problems) == 1:
            raise ChipConfigError(f"invalid chip {name!r}: {problems[0]}")
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ChipConfigError(f"invalid chip {name!r} ({len(problems)} problems):\n{listing}")
    return chip
