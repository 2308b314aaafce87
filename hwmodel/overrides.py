"""Field overrides on a chip: ``hbm.channels=64``, ``noc.link_bytes_per_cycle=128``.

``with_overrides(chip, ["hbm.channels=64", ...])`` edits the chip's YAML layout
(:func:`hwmodel.to_dict`) at each dotted path and reads it back through
:func:`hwmodel.from_dict`, so a chip with overrides is exactly the chip of the edited YAML file
and is validated the same way (every bad field reported at once).  Values are parsed as YAML
scalars or lists (``64``, ``1.5``, ``[0, 3]``).  Two derived fields follow the overrides unless
they are given too: ``num_cores`` becomes ``noc.rows x noc.cols`` when the mesh shape changes,
and on a chip whose HBM ports sit on the mesh (``hbm.attach_cores`` non-empty) the ports are
re-placed on the west/east edges (:func:`hwmodel.edge_attach_cores`) when the channel count or
the mesh changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from hwmodel.chip import Chip
from hwmodel.errors import ChipConfigError
from hwmodel.presets import edge_attach_cores
from hwmodel.serialize import from_dict, to_dict

__all__ = ["parse_override", "with_overrides"]


def parse_override(text: str) -> tuple[str, Any]:
    """``"hbm.channels=64"`` -> ``("hbm.channels", 64)``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ChipConfigError(
            f"override {text!r}: write FIELD=VALUE with a dotted field, e.g. hbm.channels=64"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node: Any = data
    for n, part in enumerate(parts):
        where = ".".join(parts[: n + 1])
        if not isinstance(node, dict):
            raise ChipConfigError(f"override {path}: {'.'.join(parts[:n])} is not a section")
        last = n == len(parts) - 1
        if part not in node and not (last and ".".join(parts[:-1]) == "core.flops_per_cycle"):
            valid = ", ".join(sorted(node))
            prefix = ".".join(parts[:n])
            raise ChipConfigError(
                f"override {path}: no field {where!r}; fields"
                f"{' of ' + prefix if prefix else ''}: {valid}"
            )
        if last:
            node[part] = value
        else:
            node = node[part]


def with_overrides(chip: Chip, overrides: Iterable[str | tuple[str, Any]]) -> Chip:
    """``chip`` with each ``FIELD=VALUE`` override applied (module docstring), validated."""
    pairs = [parse_override(o) if isinstance(o, str) else o for o in overrides]
    if not pairs:
        return chip
    data = to_dict(chip)
    keys = {k for k, _ in pairs}
    problems = []
    for key, value in pairs:
        try:
            _set(data, key, value)
        except ChipConfigError as exc:  # every field name checked before any is refused
            problems.append(str(exc))
    noc, hbm = data["noc"], data["hbm"]
    mesh_changed = bool(keys & {"noc.rows", "noc.cols"})
    if mesh_changed and "num_cores" not in keys and noc.get("kind") == "mesh":
        rows, cols = noc.get("rows"), noc.get("cols")
        if isinstance(rows, int) and isinstance(cols, int):
            data["num_cores"] = rows * cols
    replace_ports = (mesh_changed or "hbm.channels" in keys) and "hbm.attach_cores" not in keys
    if replace_ports and chip.hbm.attach_cores and noc.get("kind") == "mesh":
        rows, cols, ch = noc.get("rows"), noc.get("cols"), hbm.get("channels")
        if all(isinstance(v, int) and v > 0 for v in (rows, cols, ch)):
            hbm["attach_cores"] = list(edge_attach_cores(rows, cols, ch))
    changed = ",".join(f"{k}={v}" for k, v in pairs)
    if "name" not in keys:
        data["name"] = f"{chip.name}[{changed}]"
    if "description" not in keys and data.get("description"):
        # the preset's prose describes its own fields: say which ones no longer hold
        data["description"] = f"{data['description']} Overridden here: {changed}."
    try:
        made = from_dict(data)
    except ChipConfigError as exc:
        if not problems:
            raise ChipConfigError(f"{chip.name} with overrides: {exc}") from None
        problems.append(str(exc))  # the values of the fields it knows, checked too
    if len(problems) == 1:
        raise ChipConfigError(problems[0])
    if problems:
        raise ChipConfigError(
            f"{chip.name} with overrides: {len(problems)} problems:\n"
            + "\n".join(f"  - {u}" for u in problems)
        )
    return made
