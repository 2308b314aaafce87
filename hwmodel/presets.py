"""Named chip presets (YAML files in ``hwmodel/presets/``) and chip loading.

Each preset file cites the source of every value in a comment next to it.  ``load_chip`` takes a
preset name, the path of a YAML file, or a :class:`Chip`; the result is always validated.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from importlib import resources
from pathlib import Path

from hwmodel.chip import Chip, MeshNoC
from hwmodel.errors import ChipConfigError
from hwmodel.serialize import from_yaml
from hwmodel.validate import validate

__all__ = ["load_chip", "list_presets", "preset_path", "edge_attach_cores", "with_mesh_shape"]

_SUFFIXES = (".yaml", ".yml")


def _preset_dir() -> Path:
    return Path(str(resources.files("hwmodel") / "presets"))


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(p.stem for p in _preset_dir().iterdir() if p.suffix in _SUFFIXES)


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``."""
    path = _preset_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ChipConfigError(_unknown_message(name))
    return path


def _unknown_message(name: str) -> str:
    presets = list_presets()
    close = difflib.get_close_matches(name, presets, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown chip preset {name!r}{hint}; presets: {', '.join(presets)}; "
        "or give the path of a chip YAML file"
    )


def load_chip(name_or_path: str | os.PathLike[str] | Chip) -> Chip:
    """A validated :class:`Chip` from a preset name (``"ipu-hbm"``), a YAML file path, or a
    :class:`Chip` (validated and returned)."""
    if isinstance(name_or_path, Chip):
        return validate(name_or_path)
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in list_presets():
        path = preset_path(name_or_path)
        return from_yaml(path.read_text(encoding="utf-8"), source=f"preset {name_or_path!r}")
    path = Path(text)
    if path.is_file():
        chip = from_yaml(path.read_text(encoding="utf-8"), source=str(path))
        if chip.name in list_presets() and chip != load_chip(chip.name):
            # an edited copy of a preset (``chips --show``): its label tells the two apart
            chip = dataclasses.replace(chip, name=f"{chip.name}[{path.name}]")
        return chip
    if path.suffix in _SUFFIXES or os.sep in text or not isinstance(name_or_path, str):
        raise ChipConfigError(
            f"chip file {text!r} does not exist; give an existing YAML file or one of the "
            f"presets: {', '.join(list_presets())}"
        )
    raise ChipConfigError(_unknown_message(text))


def edge_attach_cores(rows: int, cols: int, channels: int) -> tuple[int, ...]:
    """HBM port placement on a ``rows`` x ``cols`` mesh: channels split between the west and
    east edges (west first), spread evenly over the rows of each edge.  Memory controllers sit
    at the die edge, so HBM data crosses the mesh (ELK §6.4: "mesh-based network takes
    multiple hops to deliver HBM data to cores")."""
    if rows < 1 or cols < 1 or channels < 1:
        raise ChipConfigError(
            f"edge_attach_cores: rows, cols and channels must be positive (got {rows}, {cols}, "
            f"{channels})"
        )
    west = (channels + 1) // 2 if cols > 1 else channels
    east = channels - west
    cores: list[int] = []
    for count, col in ((west, 0), (east, cols - 1)):
        for n in range(count):
            row = (2 * n + 1) * rows // (2 * count)
            cores.append(row * cols + col)
    return tuple(cores)


def with_mesh_shape(chip: Chip, rows: int, cols: int) -> Chip:
    """``chip`` cut down (or grown) to a ``rows`` x ``cols`` mesh of the same cores and links.

    The per-core spec, link bandwidth/latency, clock and HBM channel count and bandwidth are
    kept; HBM ports are re-placed on the new mesh's west/east edges when the original chip had
    placed ports (``hbm.attach_cores`` non-empty).  Used to run a program on a small mesh of a
    preset's cores (e.g. a 4x4 matmul on ``mesh`` cores)."""
    if not isinstance(chip.noc, MeshNoC):
        raise ChipConfigError(
            f"with_mesh_shape: chip {chip.name!r} has an all-to-all NoC; only a mesh chip can "
            "be reshaped"
        )
    noc = dataclasses.replace(chip.noc, rows=rows, cols=cols)
    attach = edge_attach_cores(rows, cols, chip.hbm.channels) if chip.hbm.attach_cores else ()
    hbm = dataclasses.replace(chip.hbm, attach_cores=attach)
    resized = dataclasses.replace(
        chip,
        name=f"{chip.name}@{rows}x{cols}",
        num_cores=rows * cols,
        noc=noc,
        hbm=hbm,
        description=f"{chip.description} Reshaped to a {rows}x{cols} mesh.".strip(),
    )
    return validate(resized)
