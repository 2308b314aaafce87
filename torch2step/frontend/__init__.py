"""Frontends: PyTorch modules (``torch.export``) and ONNX files raised into the layer graph.

- :func:`from_torch` (``capture`` + ``raise_program``): a module and example inputs to a
  :class:`~torch2step.layers.graph.LayerGraph`;
- :func:`capture`: the ``torch.export`` step alone (core-ATen ``ExportedProgram``);
- :func:`import_onnx`: an ONNX file to a layer graph (:mod:`torch2step.frontend.onnx_import`);
- :func:`raise_program`: an ``ExportedProgram`` to a layer graph; :data:`PATTERNS` are its
  named raising patterns, :data:`RULES` its one-to-one ATen translations.
"""

from torch2step.frontend.capture import capture, default_dynamic_axes, default_dynamic_shapes
from torch2step.frontend.raise_graph import PATTERNS, raise_program
from torch2step.frontend.raise_rules import RULES
from torch2step.frontend.torch_import import from_exported, from_torch

__all__ = [
    "PATTERNS",
    "RULES",
    "capture",
    "default_dynamic_axes",
    "default_dynamic_shapes",
    "from_exported",
    "from_torch",
    "raise_program",
    "import_onnx",
]


def __getattr__(name: str) -> object:
    # the ONNX importer is loaded on first use (it needs the onnx package)
    if name == "import_onnx":
        from torch2step.frontend.onnx_import import import_onnx

        return import_onnx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
