"""Expert regions shared in time with static tiles (STeP arXiv 2511.07776 §5.2, §5.3) whose
streams carry control values: the lanes fed by dispatch route each token's row index (a
``[1, 1]`` integer, sent as a control value) and hand each chunk's expert id and padding flags
through Partitions of control values.

Two loops must not take such streams (torch2step.spatial.stop_loop, region_loop):

* a unit looping until a Partition's stop token takes each element's first message with
  ``Recv(..., stop=reg)``, which tells the token (a plain control value) from data only: a
  unit over elements that begin with a control value keeps its unrolled program;
* a region's Partition loops over the chunks only when it routes each element by its
  selector's register (received data, counted in registers, so its stop tokens carry the whole
  run's counts): one forwarding control values keeps the run's unrolled program, while the
  rest of its region (the expert id computed from the merge's selector) still loops.

The programs validate, the simulation runs them, and the run is PyTorch's.
"""

from __future__ import annotations

import numpy as np
import pytest
from run_checks import assert_run_equals_module

import torch2step
from hwmodel.presets import load_chip
from lowering.isa import Recv, RecvValue, walk
from models import get_layer
from torch2step.lower.blocks.moe import moe_graph, moe_inputs
from torch2step.spatial import simulate_plan
from torch2step.spatial.plan import build_plan
from torch2step.step import run

KW4 = {"num_experts": 4, "top_k": 2, "hidden": 64, "intermediate": 64}
#: Expert 1 gets one token (its routed stream's elements then all have the same messages, the
#: token's row index included), experts 0, 2 and 3 the others.
ROUTE = np.array([[1, 0]] + [[0, 2 + t % 2] for t in range(15)])


@pytest.fixture(scope="module")
def mixtral():  # type: ignore[no-untyped-def]
    return get_layer("mixtral-moe", tiny=True, batch=8)


@pytest.mark.parametrize("lanes", [2, 4])
def test_lanes_with_static_tiles_run_the_layer(mixtral, lanes: int) -> None:  # type: ignore[no-untyped-def]
    """``moe_lanes`` with ``moe_static_tile`` through the public API: the report's programs
    validate (a wrong loop fails there) and the run is the module's output."""
    x = mixtral.example_inputs
    prog = torch2step.compile(
        mixtral.module, x, chip="step-sda", moe_lanes=lanes, moe_static_tile=16
    )
    rep = prog.report(*x)  # builds, validates and simulates the programs
    assert rep.latency_cycles > 0
    assert_run_equals_module(prog, mixtral.module, x)


def _reads(body: tuple) -> dict[str, set[str | None]]:
    """Per channel a program receives from, the stop registers of its receives."""
    out: dict[str, set[str | None]] = {}
    for i in walk(body):
        if isinstance(i, (Recv, RecvValue)):
            out.setdefault(i.channel, set()).add(i.stop)
    return out


def test_control_value_streams_keep_their_unrolled_programs() -> None:
    """Dispatch lanes with static tiles: the Maps over a routed token's row index (a control
    value first) do not loop until the route's stop token, not even expert 1's, whose one
    element is trivially like every other, the chunk-count Partitions of the
    expert ids and of the chunks (control values) are not looping members of the merge's
    region, the expert id's Map is, and the plan validates and simulates."""
    g = moe_graph(
        **KW4, tokens=16, lanes=2, tile_h=32, tile_i=32, static_tile=4, lane_assign="dispatch"
    )
    res = run(g, tensors=moe_inputs(**KW4, tokens=16, seed=0, routing=ROUTE), check=False)
    assert res.bindings["moe_n1"] == 1
    plan = build_plan(g, load_chip("step-sda"), res)
    progs = {p.core: p.body for p in plan.programs.programs}
    reads = {u.name: _reads(progs[u.core]) for u in plan.placement.units}
    for e in range(4):  # a token's row index, then its expert ids and weights
        for ch, stops in reads[f"moe_e{e}_part1"].items():
            assert stops == {None}, (e, ch, stops)
    sel = "moe_merge.1"  # the merge's selectors, ending with its stop token
    assert reads["moe_eid"][sel] == {f"stop.{sel}"}
    for name in ("moe_count", "moe_count_x"):
        assert sel not in reads[name], name
        assert all(stops == {None} for stops in reads[name].values()), name
    assert simulate_plan(plan, check=True).cycles > 0
