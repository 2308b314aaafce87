"""The values a split layer's configurations are timed on (``configurations._Values``): a KV
cache stand-in of lazily allocated zeros is concatenated with its new rows without copying the
zeros (``standins.concat_zeros``), and every value is the same as the plain evaluation's."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch2step.layers.standins import SMALL, concat_zeros, is_zero_standin


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    zero=st.lists(st.booleans(), min_size=4, max_size=4),
    dim=st.sampled_from([0, 1, 2, -1, -2]),
    integer=st.booleans(),
)
def test_concat_zeros_equals_torch_cat(sizes, zero, dim, integer) -> None:
    gen = torch.Generator().manual_seed(len(sizes))
    parts = []
    for n, z in zip(sizes, zero):
        shape = [2, 3, 4]
        shape[dim % 3] = n
        if integer:
            t = torch.randint(-5, 5, shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen)
        parts.append(torch.zeros_like(t) if z else t)
    flags = zero[: len(parts)]
    got = concat_zeros(parts, flags, dim)
    want = torch.cat(parts, dim=dim)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if not integer:  # bit for bit: +0.0 where the zeros are, as torch.cat copies them
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_concat_zeros_of_different_types_is_torch_cat() -> None:
    a, b = torch.zeros(2, 3), torch.ones(2, 1, dtype=torch.float64)
    assert torch.equal(concat_zeros([a, b], [True, False], 1), torch.cat([a, b], 1))


def test_zero_standins_are_the_large_and_integer_meta_tensors() -> None:
    assert is_zero_standin(torch.empty(SMALL + 1, device="meta"))
    assert not is_zero_standin(torch.empty(SMALL, device="meta"))
    assert is_zero_standin(torch.empty(3, dtype=torch.int64, device="meta"))
    assert not is_zero_standin(torch.zeros(SMALL + 1))


def test_split_layer_values_equal_the_plain_evaluation() -> None:
    """A tiny Mixtral decoder layer on ``meta`` with a KV cache large enough for zero
    stand-ins: the router's input, the attention's cache and every value computed on the way
    equal evaluating each operator in order with ``torch.cat``."""
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from models.decoder import decode_inputs, decoder_step, tiny_config
    from torch2step.configurations import _Values
    from torch2step.frontend.torch_import import from_torch
    from torch2step.layers import ops as L
    from torch2step.layers.evaluate import evaluate_node

    cfg = tiny_config("mixtral")
    step = decoder_step(cfg, device="meta")
    past = SMALL // (2 * 2 * 16) + 8  # batch 2 x 2 KV heads x head dim 16: over SMALL elements
    inputs = decode_inputs(cfg, 2, past, device="meta")
    layer = from_torch(step, inputs)
    router = next(n for n in layer.nodes if isinstance(n.op, L.TopKRouting))
    values = _Values(layer, inputs)
    assert values.zero & set(layer.inputs)  # the KV caches are zero stand-ins
    got = values.value(router.inputs[0])

    plain = _Values(layer, inputs)
    for node in layer.nodes:
        if all(o in plain.env for o in node.outputs):
            continue
        outs = evaluate_node(node, [plain.env[i] for i in node.inputs], plain.dims)
        plain.env.update(zip(node.outputs, outs))
        if node is router:
            break
    assert torch.equal(got, plain.env[router.inputs[0]])
    concats = [n for n in layer.nodes if isinstance(n.op, L.Concat)]
    assert concats
    for n in concats:
        assert torch.equal(values.env[n.outputs[0]], plain.env[n.outputs[0]])
    for name, v in values.env.items():
        assert torch.equal(v, plain.env[name]), name
