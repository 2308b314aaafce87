"""Chip descriptions to and from plain dicts and YAML.

The YAML layout mirrors the dataclasses of :mod:`hwmodel.chip` key for key (units in the key
names); ``core.flops_per_cycle`` is a mapping ``dtype: FLOPs per cycle`` and ``noc.kind`` selects
``mesh`` or ``all_to_all``.  Reading is strict: unknown keys are errors naming the valid keys,
missing required keys are named, and the result is checked by :func:`hwmodel.validate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hwmodel.chip import AllToAllNoC, Chip, CoreSpec, HbmSpec, MeshNoC
from hwmodel.errors import ChipConfigError
from hwmodel.validate import validate

__all__ = ["to_dict", "from_dict", "to_yaml", "from_yaml"]

#: Fields held as floats (bandwidths, clock); integers given for them are converted.
_FLOAT_FIELDS = frozenset(
    {
        "clock_ghz",
        "bytes_per_cycle_per_channel",
        "link_bytes_per_cycle",
        "injection_bytes_per_cycle",
        "ejection_bytes_per_cycle",
    }
)
_NOC_KINDS: dict[str, type[MeshNoC] | type[AllToAllNoC]] = {
    "mesh": MeshNoC,
    "all_to_all": AllToAllNoC,
}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def to_dict(chip: Chip) -> dict[str, Any]:
    """``chip`` as nested plain dicts/lists (the YAML layout), every field written."""
    core = {
        "flops_per_cycle": {name: value for name, value in chip.core.flops_per_cycle},
        **{
            f.name: _plain(getattr(chip.core, f.name))
            for f in dataclasses.fields(CoreSpec)
            if f.name != "flops_per_cycle"
        },
    }
    hbm = {f.name: _plain(getattr(chip.hbm, f.name)) for f in dataclasses.fields(HbmSpec)}
    noc_fields = dataclasses.fields(chip.noc)
    noc = {"kind": chip.noc.kind}
    noc.update({f.name: _plain(getattr(chip.noc, f.name)) for f in noc_fields if f.name != "kind"})
    return {
        "name": chip.name,
        "description": chip.description,
        "clock_ghz": chip.clock_ghz,
        "num_cores": chip.num_cores,
        "core": core,
        "hbm": hbm,
        "noc": noc,
        "execution": chip.execution,
        "sources": list(chip.sources),
    }


def _check_keys(data: Mapping[str, Any], cls: type, path: str, skip: tuple[str, ...] = ()) -> None:
    """Unknown keys and missing required keys of ``data`` for dataclass ``cls``."""
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    valid = [f.name for f in fields] + list(skip)
    unknown = sorted(k for k in data if k not in valid)
    where = f"{path}." if path else ""
    if unknown:
        raise ChipConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(where + str(k) for k in unknown)}; valid keys"
            f"{' of ' + path if path else ''}: {', '.join(valid)}"
        )
    missing = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
        and f.name not in data
    ]
    if missing:
        raise ChipConfigError(f"missing required key(s): {', '.join(where + m for m in missing)}")


def _mapping(data: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ChipConfigError(
            f"{path}: must be a mapping of keys to values, got {type(data).__name__}"
        )
    return data


def _value(name: str, value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if name in _FLOAT_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _build(cls: type, data: Mapping[str, Any], **extra: Any) -> Any:
    kwargs = {k: _value(k, v) for k, v in data.items() if k not in extra}
    kwargs.update(extra)
    return cls(**kwargs)


def from_dict(data: Mapping[str, Any]) -> Chip:
    """A validated :class:`Chip` from the nested-dict layout written by :func:`to_dict`."""
    data = _mapping(data, "chip")
    _check_keys(data, Chip, "")
    core_data = _mapping(data["core"], "core")
    _check_keys(core_data, CoreSpec, "core")
    flops = core_data["flops_per_cycle"]
    if not isinstance(flops, Mapping):
        raise ChipConfigError(
            f"core.flops_per_cycle: must be a mapping dtype -> FLOPs per cycle "
            f"(e.g. {{bf16: 2048, fp32: 512}}), got {type(flops).__name__}"
        )
    core = _build(
        CoreSpec,
        core_data,
        flops_per_cycle=tuple((str(k), v) for k, v in flops.items()),
    )
    hbm_data = _mapping(data["hbm"], "hbm")
    _check_keys(hbm_data, HbmSpec, "hbm")
    attach = hbm_data.get("attach_cores", [])
    if not isinstance(attach, list | tuple):
        raise ChipConfigError(
            f"hbm.attach_cores: must be a list of core ids (one per channel) or [], "
            f"got {type(attach).__name__}"
        )
    hbm = _build(HbmSpec, hbm_data)
    noc_data = _mapping(data["noc"], "noc")
    kind = noc_data.get("kind")
    if kind not in _NOC_KINDS:
        raise ChipConfigError(
            f"noc.kind = {kind!r}: must be one of {', '.join(_NOC_KINDS)} "
            "(a 2-D mesh or an all-to-all exchange)"
        )
    noc_cls = _NOC_KINDS[kind]
    _check_keys(noc_data, noc_cls, "noc")
    noc = _build(noc_cls, noc_data)
    sources = data.get("sources", [])
    if not isinstance(sources, list | tuple):
        raise ChipConfigError(f"sources: must be a list of strings, got {type(sources).__name__}")
    chip = _build(Chip, data, core=core, hbm=hbm, noc=noc, sources=tuple(sources))
    return validate(chip)


class _Dumper(yaml.SafeDumper):
    """Block mappings, flow-style lists of scalars (``attach_cores: [0, 46, ...]``)."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(isinstance(v, int | float) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def to_yaml(chip: Chip, path: str | Path | None = None) -> str:
    """``chip`` as YAML text (validated first); also written to ``path`` when given.
    ``load_chip(path)`` reads it back to an equal :class:`Chip`."""
    validate(chip)
    header = f"# chip description {chip.name!r}: units are in the key names (bytes, cycles, GHz)\n"
    text = header + yaml.dump(
        to_dict(chip),
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=100,
        allow_unicode=True,
    )
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def from_yaml(text: str, source: str = "<string>") -> Chip:
    """A validated :class:`Chip` from YAML ``text``; errors name ``source`` and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ChipConfigError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ChipConfigError(
            f"{source}: a chip file must be a YAML mapping with keys "
            f"{', '.join(f.name for f in dataclasses.fields(Chip))}"
        )
    try:
        return from_dict(data)
    except ChipConfigError as exc:
        raise ChipConfigError(f"{source}: {exc}") from None
