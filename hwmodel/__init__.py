"""Chip descriptions: frozen dataclasses with units in the field names, YAML presets, validation.

``load_chip("ipu-hbm")`` reads a shipped preset (``list_presets()``), ``load_chip("my.yaml")`` a
file; ``to_yaml(chip)`` writes one.  Every invalid field raises :class:`ChipConfigError` naming
its dotted path and what is allowed.  ``hwmodel`` imports nothing else of the project.
"""

from hwmodel.chip import AllToAllNoC, Chip, CoreSpec, HbmSpec, MeshNoC, NoC
from hwmodel.errors import ChipConfigError
from hwmodel.presets import edge_attach_cores, list_presets, load_chip, preset_path, with_mesh_shape
from hwmodel.serialize import from_dict, from_yaml, to_dict, to_yaml
from hwmodel.validate import chip_problems, validate

__all__ = [
    "AllToAllNoC",
    "Chip",
    "ChipConfigError",
    "CoreSpec",
    "HbmSpec",
    "MeshNoC",
    "NoC",
    "chip_problems",
    "edge_attach_cores",
    "from_dict",
    "from_yaml",
    "list_presets",
    "load_chip",
    "preset_path",
    "to_dict",
    "to_yaml",
    "validate",
    "with_mesh_shape",
]
