"""A decoder layer that does not fit the chip's cores is reported as sequential spatial
configurations (the split printed in the notes); the configurations chained compute the layer;
on a chip it fits, it is placed whole."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch2step  # noqa: E402
from hwmodel import load_chip  # noqa: E402
from hwmodel.presets import with_mesh_shape  # noqa: E402
from models.decoder import decode_inputs, decoder_step, tiny_config  # noqa: E402
from torch2step.configurations import split_layer, subgraph  # noqa: E402
from torch2step.lower import LowerOptions, lower  # noqa: E402
from torch2step.step import run  # noqa: E402


@pytest.fixture(scope="module")
def layer():
    cfg = tiny_config("llama")
    step = decoder_step(cfg, device="cpu")
    return step, decode_inputs(cfg, 3, 9)


def test_decoder_layer_split_into_configurations_that_fit(layer) -> None:
    step, args = layer
    chip = with_mesh_shape(load_chip("mesh"), 4, 8)
    rep = torch2step.compile(step, args, chip=chip, execution="spatial").report(*args)
    k = rep.dynamic["configurations"]
    assert k > 1
    lines = [n for n in rep.notes if n.startswith("configuration ")]
    assert len(lines) == k and "split into" in str(rep)
    parts = [int(n.rsplit(", ", 1)[1].split()[0].replace(",", "")) for n in lines]
    assert sum(parts) == rep.latency_cycles
    for n in lines:
        assert int(n.split(" units")[0].rsplit(", ", 1)[1]) <= chip.num_cores
    assert len({u["configuration"] for u in rep.units}) == k


def test_configurations_chained_compute_the_layer(layer) -> None:
    step, args = layer
    graph = torch2step.compile(step, args).layer
    groups = split_layer(graph, 32, LowerOptions(attn_lanes=1))  # as compile does on 32 cores
    assert len(groups) > 1 and [n for g in groups for n in g] == graph.nodes
    env = dict(zip(graph.inputs, args))
    for k, group in enumerate(groups):
        sub = subgraph(graph, group, f"c{k}")
        lw = lower(sub)
        xs = [env[v] for v in sub.inputs]
        tensors, bindings = lw.feed(xs)
        res = run(lw.program, tensors=tensors, env=bindings)
        env.update(zip(sub.outputs, lw.outputs(res.tensors, xs)))
    with torch.no_grad():
        want = step(*args)
    for name, w in zip(graph.outputs, want):
        torch.testing.assert_close(env[name], w, atol=1e-4, rtol=0)


def test_layer_that_fits_is_placed_whole(layer) -> None:
    step, args = layer
    rep = torch2step.compile(step, args).report(*args)
    assert "configurations" not in rep.dynamic
    assert not any(n.startswith("configuration ") for n in rep.notes)


def test_split_report_writes_one_timeline_of_its_configurations(layer, tmp_path) -> None:
    import json

    from runtime.trace import trace_problems

    step, args = layer
    chip = with_mesh_shape(load_chip("mesh"), 4, 8)
    prog = torch2step.compile(step, args, chip=chip, execution="spatial")
    rep = prog.report(*args, trace=True)
    k = rep.dynamic["configurations"]
    rep.save(tmp_path / "run", trace=prog)
    doc = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert trace_problems(doc) == []
    names = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"]
    # one name per track: a core's lists its unit in each configuration ("1: ... | 2: ...")
    tracks = [(e["pid"], e["tid"]) for e in doc["traceEvents"] if e.get("name") == "thread_name"]
    assert len(tracks) == len(set(tracks))
    assert all(any(f"{i}: " in n for n in names) for i in range(1, k + 1))
    ends = [e["ts"] + e.get("dur", 0) for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert max(ends) <= rep.latency_cycles
    lines = [n for n in rep.notes if n.startswith("configuration ")]
    cycles = [int(n.rsplit(", ", 1)[1].split()[0].replace(",", "")) for n in lines]
    # the configurations run one after another: the last one's events end after the others'
    assert max(ends) > sum(cycles[:-1])


def test_operator_too_large_alone_reports_its_error_after_one_more_plan(layer, monkeypatch) -> None:
    # SRAM so small that an operator's buffers alone take more cores than the chip has: its
    # placement error comes from the whole layer's plan and that operator's, not from halving
    import dataclasses

    import torch2step.spatial.reuse as reuse
    from torch2step.spatial.placement import PlacementError

    step, args = layer
    chip = load_chip("step-sda")
    chip = dataclasses.replace(chip, core=dataclasses.replace(chip.core, sram_bytes=16))
    built: list[str] = []
    plan = reuse.build_plan

    def counting(graph, *a, **k):
        built.append(graph.name)
        return plan(graph, *a, **k)

    monkeypatch.setattr(reuse, "build_plan", counting)
    prog = torch2step.compile(step, args, chip=chip, execution="spatial")
    with pytest.raises(PlacementError, match=r"needs \d+ cores") as err:
        prog.report(*args)
    assert len(built) == 2 and built[0] == prog.layer.name
    op = built[1].removeprefix(f"{prog.layer.name}_")
    assert op in {n.name for n in prog.layer.nodes} and f"graph '{built[1]}'" in str(err.value)
    assert sum(err.value.cores.values()) > chip.num_cores
