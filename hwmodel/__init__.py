"""Chip descriptions: frozen dataclasses with units in the field names, YAML presets, validation.

``load_chip("ipu-hbm")`` reads a shipped preset (``list_presets()``), ``load_chip("my.yaml")`` a
file; ``to_yaml(chip)`` writes one.  Every invalid field raises :class:`ChipConfigError` naming
its dotted path and what is allowed; ``with_overrides(chip, ["hbm.channels=64"])`` edits fields.  ``hwmodel`` imports nothing else of the project.
"""

from hwmodel.chip import AllToAllNoC, Chip, CoreSpec, HbmSpec, MeshNoC, NoC
from hwmodel.errors import ChipConfigError, Torch2StepError
from hwmodel.overrides import parse_override, with_overrides
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
    "Torch2StepError",
    "chip_problems",
    "edge_attach_cores",
    "from_dict",
    "from_yaml",
    "list_presets",
    "parse_override",
    "load_chip",
    "preset_path",
    "to_dict",
    "to_yaml",
    "validate",
    "with_mesh_shape",
    "with_overrides",
]
