"""Determinism, statistics invariants, the Chrome trace, and the HBM channel split."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_testkit import a2a_chip, cannon_chip, cannon_programs, hbm, mesh_chip

import lowering
from lowering.isa import TensorDecl
from runtime import simulate
from runtime.layout import HbmLayout


def test_two_runs_give_identical_statistics_and_trace_files(tmp_path):
    chip = mesh_chip(4, 4)
    ps = lowering.summa_matmul(chip, 64, 64, 64, grid=(4, 4))
    r1 = simulate(ps, chip, trace=tmp_path / "a.json")
    r2 = simulate(ps, chip, trace=tmp_path / "b.json")
    assert r1.stats == r2.stats and r1.cycles == r2.cycles
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_trace_has_a_track_per_core_link_and_channel(tmp_path):
    r = simulate(cannon_programs(3), cannon_chip(3), trace=True)
    doc = json.loads(r.trace_json())
    events = doc["traceEvents"]
    names = {
        (e["pid"], e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert {n for p, n in names if p == 1} == {f"core {i} (r{i // 3}c{i % 3})" for i in range(9)}
    assert {n for p, n in names if p == 4} == {f"hbm channel {c}" for c in range(3)}
    assert sum(1 for p, n in names if p == 2) == sum(1 for x in r.stats.links if x.transfers)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] + e["dur"] <= r.cycles for e in spans)
    # every HBM channel span is one served request; the busy cycles add up
    for c, stat in enumerate(r.stats.hbm_channels):
        tid = next(
            e["tid"]
            for e in events
            if e["ph"] == "M" and e.get("args", {}).get("name") == f"hbm channel {c}"
        )
        assert sum(e["dur"] for e in spans if e["pid"] == 4 and e["tid"] == tid) == stat.busy
    # compute spans per core add up to its busy cycles
    for core in r.stats.cores:
        assert (
            sum(
                e["dur"]
                for e in spans
                if e["pid"] == 1 and e["tid"] == core.core and e["cat"] == "compute"
            )
            == core.busy
        )
    path = r.write_trace(tmp_path / "t.json")
    assert json.loads(path.read_text())["otherData"]["cycles"] == r.cycles
    assert simulate(cannon_programs(3), cannon_chip(3)).trace_events == ()


def test_every_core_cycle_is_in_exactly_one_category():
    for ps, chip in [
        (cannon_programs(4), cannon_chip(4)),
        (lowering.weight_stationary_matmul((4, 4), 64, 64, 64), mesh_chip(4, 4)),
        (lowering.cannon_matmul((4, 4), 64, 64, 64), a2a_chip(16)),
    ]:
        r = simulate(ps, chip)
        for c in r.stats.cores:
            assert (
                c.busy + c.stall_recv + c.stall_send + c.stall_mem + c.stall_barrier + c.idle
                == r.cycles
            )
        assert all(
            0.0 <= x.utilisation <= 1.0
            for x in r.stats.links + r.stats.ports + r.stats.hbm_channels
        )
        text = r.summary()
        assert f"{r.cycles} cycles" in text and "events:" in text


def test_bytes_moved_by_kind():
    # Cannon 4x4, 512-byte blocks: 16 cores send 2 blocks in each of 3 shifts; per shift and
    # per operand every ring has three 1-hop shifts and one 3-hop wrap-around (6 link hops).
    r = simulate(cannon_programs(4), cannon_chip(4))
    moved = dict(r.stats.bytes_moved)
    assert moved["noc_messages"] == 16 * 2 * 3 * 512
    assert moved["noc_link_traffic"] == 3 * 2 * 4 * 6 * 512
    assert moved["hbm_read"] == 2 * 64 * 64 * 2 and moved["hbm_write"] == 64 * 64 * 2
    assert sum(x.bytes for x in r.stats.links) == moved["noc_link_traffic"]


def _brute_split(shape, dtype_bytes, starts, extents, base, gran, chans):
    strides = [int(np.prod(shape[i + 1 :])) for i in range(len(shape))]
    out = [0] * chans
    for idx in np.ndindex(*extents):
        off = base + dtype_bytes * sum((s + i) * st for s, i, st in zip(starts, idx, strides))
        for b in range(off, off + dtype_bytes):
            out[(b // gran) % chans] += 1
    return out


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    chans=st.integers(1, 5),
    gran=st.sampled_from([2, 8, 32, 64]),
    dtype=st.sampled_from(["bf16", "fp32", "int8"]),
)
def test_channel_split_matches_byte_by_byte_count(data, chans, gran, dtype):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    starts = tuple(data.draw(st.integers(0, d - 1)) for d in shape)
    extents = tuple(data.draw(st.integers(1, d - s)) for d, s in zip(shape, starts))
    decls = (
        TensorDecl("pad", (data.draw(st.integers(1, 50)),), "int8"),
        TensorDecl("t", shape, dtype),
    )
    layout = HbmLayout(hbm(channels=chans, interleave=gran), decls)
    info = layout.tensors["t"]
    assert info.base % (chans * gran) == 0
    got = dict(layout.split(info, starts, extents))
    want = _brute_split(shape, info.elem_bytes, starts, extents, info.base, gran, chans)
    assert [got.get(c, 0) for c in range(chans)] == want
