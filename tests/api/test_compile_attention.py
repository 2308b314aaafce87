"""One compiled decode step of HF Qwen3 / Llama attention (GQA: 8 query heads, 2 KV heads)
serves every KV length; outputs equal PyTorch and the latency grows with the KV length."""

from __future__ import annotations

import pytest
import torch
from torch_blocks import HEAD_DIM, HEADS, KV_HEADS, DecodeStep, decode_inputs

import torch2step
from torch2step.spatial.unit_reuse import UnitCache
from torch2step.step import LinearOffChipStore, Map
from torch2step.step.types import TupleType

CASES = ["qwen3-sdpa", "llama-sdpa", "qwen3-eager"]


@pytest.fixture(scope="module")
def compiled() -> dict[str, tuple[torch.nn.Module, torch2step.Program]]:
    out = {}
    for case in CASES:
        family, impl = case.split("-")
        module = DecodeStep(family, impl).eval()
        out[case] = (module, torch2step.compile(module, decode_inputs(2, 5, 0)))
    return out


@pytest.mark.parametrize("case", CASES)
def test_one_program_serves_every_kv_length(case: str, compiled: dict) -> None:
    module, prog = compiled[case]
    latencies = []
    for past in (1, 17, 300):
        xs = decode_inputs(3, past, past)
        with torch.no_grad():
            want = module(*xs)
        got = prog.run(*xs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        latencies.append(prog.report(*xs).latency_cycles)
    # KV is loaded in tiles of 64 rows: 1 and 17 rows are one tile each, 300 rows are five
    assert latencies[0] <= latencies[1] < latencies[2], latencies


def test_qk_norm_and_rotary_stream_whole_request_tiles(compiled: dict) -> None:
    """Qwen3's q/k RMSNorm and RoPE read the projections' streamed rows as one
    ``[heads, head_dim]`` tile per request (not one message per head row), and the rotated q
    is stored in those tiles; no intermediate of the chain is stored."""
    _, prog = compiled["qwen3-sdpa"]
    nodes = prog.step.nodes
    for name in ("rmsnorm", "rotary"):
        shapes = set()
        for op in nodes:
            if isinstance(op, Map) and op.fn.name == name:
                t = op.inputs()[0].type.dtype
                t = t.elems[0] if isinstance(t, TupleType) else t  # (x, weight / position)
                shapes.add(tuple(int(d) for d in t.shape))
        assert shapes == {(HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM)}, (name, shapes)
    stored = {op.tensor.name for op in nodes if isinstance(op, LinearOffChipStore)}
    assert stored == {"rotary", "linear_3"}  # q for the attention lanes; the layer's output


def test_ragged_kv_lengths() -> None:
    module = DecodeStep("qwen3", "sdpa").eval()
    prog = torch2step.compile(module, decode_inputs(2, 6, 0, lengths=True))
    for batch, past, seed in ((3, 9, 1), (4, 40, 2)):
        xs = decode_inputs(batch, past, seed, lengths=True)
        with torch.no_grad():
            want = module(*xs)
        for a, b in zip(prog.run(*xs), want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    short = list(decode_inputs(4, 64, 5, lengths=True))
    long = list(short)
    short[3] = torch.tensor([1, 2, 1, 3])
    long[3] = torch.tensor([60, 64, 50, 64])
    assert prog.report(*short).latency_cycles < prog.report(*long).latency_cycles


@pytest.mark.parametrize(
    "assign", ["coarse", pytest.param("interleave", marks=pytest.mark.slow), "dynamic"]
)
def test_attention_regions_compile_option(assign: str) -> None:
    """STeP §5.4: requests spread over 2 regions run like PyTorch, ragged lengths incl. 1."""
    module = DecodeStep("qwen3", "sdpa").eval()
    prog = torch2step.compile(
        module, decode_inputs(2, 6, 0, lengths=True), attn_regions=2, attn_assign=assign
    )
    xs = list(decode_inputs(5, 24, 3, lengths=True))
    xs[3] = torch.tensor([1, 24, 3, 1, 17])
    with torch.no_grad():
        want = module(*xs)
    for a, b in zip(prog.run(*xs), want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    rep = prog.report(*xs)
    assert rep.latency_cycles > 0
    if assign == "dynamic":
        regions = rep.dynamic["attn_regions_of_requests"]
        assert regions[:2] == [0, 1] and len(regions) == 5


def test_attention_regions_option_is_checked() -> None:
    from torch2step.lower import LowerOptions

    with pytest.raises(torch2step.Torch2StepError, match="attn_assign"):
        LowerOptions(attn_regions=2, attn_assign="random")
    with pytest.raises(torch2step.Torch2StepError, match="attn_regions"):
        LowerOptions(attn_regions=0)


@pytest.mark.parametrize(
    "options", [{}, {"attn_regions": 2, "attn_assign": "interleave"}], ids=["lanes", "regions"]
)
def test_a_new_kv_length_set_rebuilds_no_unit(monkeypatch, options: dict) -> None:
    """``report`` on a second KV-length set assembles its plan from the first set's unit
    programs without emitting any again — the next decode step, and a set with other tile
    counts per request (a request of KV length 1 included): every attention lane (or region
    of STeP §5.4, with a static assignment) computes its request cursors in registers, cuts
    them into tile addresses and loops over each request's tile count at run time
    (torch2step.spatial.kv_loop); its cycles and on-chip bytes are those of a fresh program's
    report, and the run is PyTorch's."""
    module = DecodeStep("qwen3", "sdpa").eval()
    prog = torch2step.compile(module, decode_inputs(2, 6, 0, lengths=True), **options)
    first = list(decode_inputs(4, 160, 5, lengths=True))
    first[3] = torch.tensor([20, 64, 1, 33])
    prog.report(*first)
    built: list[str] = []
    store = UnitCache.store

    def record(self, k, key, deps, run, body, info) -> None:  # the units emitted again
        built.append(info.name)
        store(self, k, key, deps, run, body, info)

    monkeypatch.setattr(UnitCache, "store", record)
    for lengths in ([21, 63, 2, 34], [150, 1, 65, 129]):  # next step; other tile counts
        second = list(first)
        second[3] = torch.tensor(lengths)
        again = prog.report(*second)
        assert built == [], built
        fresh = torch2step.compile(module, decode_inputs(2, 6, 0, lengths=True), **options)
        want = fresh.report(*second)
        built.clear()
        assert again.latency_cycles == want.latency_cycles
        assert again.simulated_onchip_bytes == want.simulated_onchip_bytes
        for xs in (first, second):
            with torch.no_grad():
                ref = module(*xs)
            for a, b in zip(prog.run(*xs), ref):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def _lane_items(lengths: list[int], lanes: int, tail: int = 1) -> list[int]:
    """Items per lane of the lanes' list scheduling (``lane_pick``): each (request, KV head)
    to the lane with the fewest rows so far, ties to the lowest."""
    load, items = [0] * lanes, [0] * lanes
    for n in lengths:
        for _ in range(KV_HEADS):
            lane = load.index(min(load))
            load[lane] += n + tail + 1
            items[lane] += 1
    return items


@pytest.mark.parametrize(
    "options",
    [{"attn_lanes": 3}, {"attn_regions": 2, "attn_assign": "dynamic"}],
    ids=["lanes", "dynamic-regions"],
)
def test_a_new_assignment_of_requests_rebuilds_no_unit(monkeypatch, options: dict) -> None:
    """STeP §5.4: a KV-length set that gives the lanes (list scheduling by KV rows) or the
    regions (the first region that becomes free, decided in simulated time) other requests
    takes every unit program of the first set as it is — the lane decisions are computed in
    registers and every unit of a lane or region loops until its items' stop token
    (torch2step.spatial.item_loop); the report is a fresh program's and the run PyTorch's."""
    module = DecodeStep("qwen3", "sdpa").eval()
    prog = torch2step.compile(module, decode_inputs(2, 6, 0, lengths=True), **options)
    first = list(decode_inputs(5, 160, 5, lengths=True))
    second = list(first)
    first[3] = torch.tensor([150, 1, 2, 3, 100])
    second[3] = torch.tensor([1, 150, 3, 140, 1])
    rep = prog.report(*first)
    built: list[str] = []
    kept: list[str] = []
    store, lookup = UnitCache.store, UnitCache.lookup

    def record(self, k, key, deps, run, body, info) -> None:  # the units emitted again
        built.append(info.name)
        store(self, k, key, deps, run, body, info)

    def found(self, *args, **kw):  # the units taken as they were
        hit = lookup(self, *args, **kw)
        if hit is not None:
            kept.append(hit.info.name)
        return hit

    monkeypatch.setattr(UnitCache, "store", record)
    monkeypatch.setattr(UnitCache, "lookup", found)
    again = prog.report(*second)
    if "attn_regions" in options:  # the dispatch decided another assignment
        assert rep.dynamic["attn_regions_of_requests"] != again.dynamic["attn_regions_of_requests"]
    else:
        lens = [[int(n) for n in xs[3]] for xs in (first, second)]
        assert _lane_items(lens[0], 3) != _lane_items(lens[1], 3)
    assert built == [], f"rebuilt {built}; kept {kept}"
    assert len(kept) == len(again.units) > 0, kept
    monkeypatch.undo()
    fresh = torch2step.compile(module, decode_inputs(2, 6, 0, lengths=True), **options)
    want = fresh.report(*second)
    assert again.latency_cycles == want.latency_cycles
    assert again.simulated_onchip_bytes == want.simulated_onchip_bytes
    for xs in (first, second):
        with torch.no_grad():
            ref = module(*xs)
        for a, b in zip(prog.run(*xs), ref):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
