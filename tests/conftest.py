"""Fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_llama_stack() -> Callable[[int], tuple[Any, Any, Any, Any]]:
    """A factory: ``make(n)`` gives the layer graph of ``n`` stacked tiny Llama decoder layers
    with distinct weights (seeds ``0..n-1``) and one layer's decode inputs ``(x, k, v)``
    (batch 2, KV length 5).  The layers and the captured body graph are built once per seed
    and shared by every ``make`` (``stack_graph`` only reads the body; nothing writes the
    weights)."""
    from models.decoder import decode_inputs, decoder_step, tiny_config
    from torch2step.frontend import from_torch
    from torch2step.layers.stack import stack_graph

    cfg = tiny_config("llama")
    x, k, v = decode_inputs(cfg, 2, 5, seed=3)
    steps: list[Any] = []
    bodies: list[Any] = []

    def make(n: int) -> tuple[Any, Any, Any, Any]:
        while len(steps) < n:
            steps.append(decoder_step(cfg, device="cpu", seed=len(steps)))
        if not bodies:
            bodies.append(from_torch(steps[0], (x, k, v)))
        weights = [{name: p.detach() for name, p in s.named_parameters()} for s in steps[:n]]
        return stack_graph(bodies[0], n, layer_params=weights), x, k, v

    return make
