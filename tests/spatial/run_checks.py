"""Shared by the spatial tests: a compiled program's functional run against its module."""

from __future__ import annotations

from typing import Any

import torch


def assert_run_equals_module(prog: Any, module: torch.nn.Module, inputs: tuple) -> None:
    """``prog.run(*inputs)`` equals ``module(*inputs)`` (first output of a tuple)."""
    with torch.no_grad():
        want = module(*inputs)
    want = want[0] if isinstance(want, tuple) else want
    got = prog.run(*inputs)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
