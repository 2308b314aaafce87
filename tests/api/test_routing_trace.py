"""A routing trace replaces the router's top-k decision, not its work: with the router's own
choice passed back in, the report equals the plain report, and the router's units are there."""

from __future__ import annotations

import numpy as np
import pytest

import torch2step
from models import get_layer
from torch2step.errors import Torch2StepError
from torch2step.layers import ops as L
from torch2step.step.ops_memory import LinearOffChipStore


def test_trace_of_the_routers_own_choice_reports_the_same() -> None:
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(spec.module, spec.example_inputs, chip="step-sda")
    router = next(iter(prog.layer.ops(L.TopKRouting)))
    ids_tensor = prog.lowered.placed[router.outputs[1]].tensor.name
    plain = prog.report(*spec.example_inputs)
    store = next(
        op.name
        for op in prog.step.nodes
        if isinstance(op, LinearOffChipStore) and op.tensor.name == ids_tensor
    )
    # the router's own choice, read back from the run the plain report simulated
    _, res, _, _ = prog._execute(spec.example_inputs)
    ids = np.asarray(res.tensors[ids_tensor]).reshape(-1, router.op.k)
    traced = prog.report(*spec.example_inputs, routing=ids)
    assert plain.dtype == "fp32"  # the tiny HF layer is built in fp32 and timed as such
    assert plain.simulated_onchip_bytes > 0
    assert traced.latency_cycles == plain.latency_cycles
    assert traced.hbm_bytes == plain.hbm_bytes
    names = {u["name"] for u in traced.units}
    assert names == {u["name"] for u in plain.units}
    assert any(store in u["ops"] for u in traced.units), "the router's store unit is simulated"
    # a different trace changes only the experts' share: the router units stay, timed
    other = np.stack([np.arange(ids.shape[0]) % 2, 2 + np.arange(ids.shape[0]) % 2], axis=1)
    moved = prog.report(*spec.example_inputs, routing=other)
    assert any(store in u["ops"] for u in moved.units)
    assert moved.dynamic["tokens_per_expert"][:4] == [4, 4, 4, 4]


def test_static_tiling_compile_option_runs_like_pytorch() -> None:
    """``moe_static_tile`` (STeP §5.2) through the public API: same output as the module,
    more off-chip bytes than dynamic tiling when an expert needs several tiles."""
    import torch

    spec = get_layer("mixtral-moe", tiny=True, batch=8)
    x = spec.example_inputs
    dyn = torch2step.compile(spec.module, x, chip="step-sda")
    st = torch2step.compile(spec.module, x, chip="step-sda", moe_static_tile=2)
    with torch.no_grad():
        want = spec.module(*x)
    want = want[0] if isinstance(want, tuple) else want
    got = st.run(*x)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    a, b = dyn.report(*x), st.report(*x)
    assert b.hbm_bytes > a.hbm_bytes


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.array([[0, 1]] * 3), "one row of expert ids per input token"),
        (np.full((8, 2), 0.5), "integer expert ids"),
        (np.array([[0, 99]] * 8), "is expert 99"),
        (np.array([[1, 1]] * 8), "chooses an expert twice"),
        (np.zeros((8, 3), dtype=np.int64), r"routing must be \[tokens, 2\]"),
    ],
)
def test_bad_routing_is_one_clear_error(bad, match) -> None:
    spec = get_layer("qwen3-moe", tiny=True, batch=8)
    prog = torch2step.compile(spec.module, spec.example_inputs, chip="step-sda")
    with pytest.raises(Torch2StepError, match=match):
        prog.report(*spec.example_inputs, routing=bad)


@pytest.mark.parametrize("batch", [-3, 0])
def test_get_layer_rejects_a_non_positive_batch(batch) -> None:
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        get_layer("qwen3-moe", tiny=True, batch=batch)


def _split_decoder():
    pytest.importorskip("transformers")
    from hwmodel import load_chip
    from hwmodel.presets import with_mesh_shape
    from models.decoder import decode_inputs, decoder_step, tiny_config

    cfg = tiny_config("qwen3_moe")
    step, args = decoder_step(cfg, device="cpu"), decode_inputs(cfg, 3, 9)
    # a 10 x 10 mesh holds the router's and the experts' halves only one at a time
    prog = torch2step.compile(
        step, args, chip=with_mesh_shape(load_chip("mesh"), 10, 10), execution="spatial"
    )
    return prog, args, cfg.num_experts


def _experts_cycles(rep) -> int:
    line = next(n for n in rep.notes if n.startswith("configuration 2:"))
    return int(line.rsplit(", ", 1)[1].split()[0].replace(",", ""))


def test_a_split_decoder_layer_routes_its_experts_configuration_by_the_trace() -> None:
    # the router runs in the first configuration, the experts in the second: the trace must
    # reach the second one (it reads the routing from HBM), and the report counts its tokens
    prog, args, experts = _split_decoder()
    spread = np.array([[0, 1], [3, 0], [2, 3]])
    bunched = np.array([[0, 1], [0, 1], [0, 1]])
    a = prog.report(*args, routing=spread, notes=["routing: a test trace"])
    b = prog.report(*args, routing=bunched)
    assert a.dynamic["configurations"] == b.dynamic["configurations"] == 2
    assert a.dynamic["tokens_per_expert"] == np.bincount(spread.ravel(), minlength=experts).tolist()
    assert b.dynamic["tokens_per_expert"] == [3, 3, 0, 0]
    assert _experts_cycles(a) != _experts_cycles(b)  # four experts loaded against two
    assert "routing: a test trace" in a.notes  # the caller's notes stay in a split report
    with pytest.raises(Torch2StepError, match=r"shape \[2, 2\]"):
        prog.report(*args, routing=spread[:2])
