"""``ArgMin``: decode attention's lane decision (the least loaded lane takes the item, STeP
arXiv 2511.07776 §5.4) in one register instruction.  The reference interpreter, the simulator
in both modes and its untimed replay agree on it, it decides as the chain of ``If`` it stands
for (same decisions, same cycles: both are zero-cycle register operations), and the program
checks and the printer know it."""

from __future__ import annotations

import numpy as np
import pytest

from hwmodel import load_chip
from lowering.isa import (
    Affine,
    Alloc,
    ArgMin,
    Compute,
    Cond,
    Free,
    If,
    Instr,
    Load,
    LoadValue,
    Program,
    ProgramSet,
    Region,
    Set,
    Store,
    TensorDecl,
    WriteValue,
)
from lowering.printer import format_instr
from lowering.reference import run_reference
from lowering.validate import program_problems
from runtime import simulate
from runtime.engine import Simulator

LANES = 4
ROWS = np.array([5, 1, 1, 9, 0, 3, 3, 2, 7, 1, 4, 4], dtype=np.int64)
LOAD = [f"l{j}" for j in range(LANES)]
INPUTS = {"rows": ROWS, "x": np.zeros((LANES, 64), dtype=np.float32)}


def _chain() -> tuple[Instr, ...]:
    """The ``If`` chain the lanes used before ``ArgMin`` (ties to the lowest lane)."""
    body: list[Instr] = [Set("lane", 0), Set("min", LOAD[0])]
    for j in range(1, LANES):
        body.append(If(Cond(LOAD[j], "<", "min"), (Set("min", LOAD[j]), Set("lane", j))))
    for j in range(LANES):
        grow = Set(LOAD[j], Affine(2, ((LOAD[j], 1), ("n", 1))))
        body.append(If(Cond("lane", "==", j), (grow,)))
    return tuple(body)


def _programs(chain: bool) -> ProgramSet:
    """Core 0 gives each of ``len(ROWS)`` items (its rows read from HBM) to the least loaded
    lane, the lane's load growing by ``rows + 2``; after each decision a kernel runs on a tile
    whose rows are the lane's index + 1 (so a wrong decision would change the cycles), and the
    lanes chosen and the final loads are stored."""
    items = len(ROWS)
    pick: tuple[Instr, ...] = (
        _chain() if chain else (ArgMin("lane", tuple(LOAD), Affine(2, (("n", 1),))),)
    )
    steps: list[Instr] = []
    for k in range(items):
        steps += [LoadValue("n", "rows", (k,)), *pick, WriteValue("lanes", k, "lane")]
        rows = Region((0, 0), (Affine(1, (("lane", 1),)), 64))  # the lane's index + 1 rows
        steps += [Alloc(f"t{k}", (LANES, 64), "bf16"), Load(f"t{k}", "x", rows)]
        steps += [Compute("copy", (f"t{k}",), (f"t{k}",)), Free(f"t{k}")]
    prog = Program(
        0,
        (
            Alloc("lanes", (items,), "int64"),
            Alloc("loads", (LANES,), "int64"),
            Load("lanes", "lanes_out"),  # zeros: the buffers hold values to write into
            Load("loads", "loads_out"),
            *(Set(r, 0) for r in LOAD),
            *steps,
            *(WriteValue("loads", j, r) for j, r in enumerate(LOAD)),
            Store("lanes", "lanes_out"),
            Store("loads", "loads_out"),
        ),
    )
    return ProgramSet(
        (prog,),
        (),
        (
            TensorDecl("rows", (items,), "int64"),
            TensorDecl("x", (LANES, 64), "bf16"),
            TensorDecl("lanes_out", (items,), "int64"),
            TensorDecl("loads_out", (LANES,), "int64"),
        ),
    )


def _expected() -> tuple[list[int], list[int]]:
    load = [0] * LANES
    lanes = []
    for n in ROWS.tolist():
        j = int(np.argmin(load))
        load[j] += n + 2
        lanes.append(j)
    return lanes, load


def test_argmin_decides_as_argmin_in_every_interpreter() -> None:
    ps = _programs(chain=False)
    chip = load_chip("step-sda")
    assert not program_problems(ps, chip)[0]
    lanes, load = _expected()
    ref = run_reference(ps, INPUTS)
    assert ref["lanes_out"].tolist() == lanes and ref["loads_out"].tolist() == load
    res = simulate(ps, chip, mode="functional", inputs=INPUTS)
    assert res.tensors["lanes_out"].tolist() == lanes
    assert res.tensors["loads_out"].tolist() == load


def test_argmin_takes_the_cycles_of_the_if_chain() -> None:
    """Each decision sets the rows a later load reads, so the cycles follow the decisions."""
    chip = load_chip("step-sda")
    one = simulate(_programs(chain=False), chip, inputs=INPUTS)  # timing mode
    chain = simulate(_programs(chain=True), chip, inputs=INPUTS)
    assert one.cycles == chain.cycles > 0
    assert one.stats.cores[0].busy == chain.stats.cores[0].busy


def test_ties_go_to_the_lowest_register_and_add_reads_the_old_values() -> None:
    prog = Program(
        0,
        (
            Alloc("o", (4,), "int64"),
            Load("o", "out"),
            Set("a", 3),
            Set("b", 1),
            Set("c", 1),
            ArgMin("k", ("a", "b", "c"), Affine(10, (("b", 1),))),  # b: 1 + (10 + 1)
            WriteValue("o", 0, "k"),
            WriteValue("o", 1, "b"),
            ArgMin("k", ("a", "b", "c")),  # no growth: c (1) is now the least
            WriteValue("o", 2, "k"),
            WriteValue("o", 3, "c"),
            Store("o", "out"),
        ),
    )
    ps = ProgramSet((prog,), (), (TensorDecl("out", (4,), "int64"),))
    want = [1, 12, 2, 1]
    assert run_reference(ps, {})["out"].tolist() == want
    assert simulate(ps, load_chip("step-sda"), mode="functional").tensors["out"].tolist() == want


def test_the_untimed_replay_runs_it() -> None:
    sim = Simulator(_programs(chain=False), load_chip("step-sda"), inputs=INPUTS)
    replay = sim.replay()
    replay.run()
    assert replay.ndone == 1
    replay.close()


def test_checks_and_printer_know_it() -> None:
    prog = Program(0, (Set("a", 1), ArgMin("k", ("a", "z"), "a")))
    problems = program_problems(ProgramSet((prog,)), load_chip("step-sda"))[0]
    assert any("'z'" in p for p in problems), problems
    empty = program_problems(ProgramSet((Program(0, (ArgMin("k", ()),)),)), load_chip("step-sda"))
    assert any("no register" in p for p in empty[0])
    text = format_instr(ArgMin("k", ("a", "b"), Affine(1, (("n", 1),))))
    assert text.startswith("argmin k <- a, b") and "grows" in text


@pytest.mark.parametrize("chain", [False, True])
def test_both_forms_pass_the_program_checks(chain: bool) -> None:
    assert not program_problems(_programs(chain), load_chip("step-sda"))[0]


def test_only_the_lane_is_written_when_only_lane_keep_reads_the_state() -> None:
    """The lanes' ``lane_keep`` read the state tile's last element (the lane) alone, so the
    ``lane_pick`` units write just that element; a node reading the whole tile keeps the
    loads' writes."""
    from types import SimpleNamespace

    from torch2step.lower.blocks.gqa import gqa_decode_graph
    from torch2step.spatial.lane_pick import lane_only_readers
    from torch2step.spatial.structure import DEFAULT_WIRES, analyse
    from torch2step.step import Scan

    prog = gqa_decode_graph(
        num_q_heads=4, num_kv_heads=2, head_dim=32, tail_rows=1, tile_kv=16, lanes=3,
        dtype="bf16",
    )  # fmt: skip
    st = analyse(prog, DEFAULT_WIRES)
    picks = [op for op in prog.nodes if isinstance(op, Scan) and op.fn.name == "lane_pick"]
    assert len(picks) == 3
    assert all(lane_only_readers(st, op) for op in picks)
    state = next(
        v for op, outs in zip(prog.nodes, prog.node_outputs) if op is picks[0] for v in outs
    )
    other = SimpleNamespace(name="reads_all", inputs=lambda: (state,))
    wider = SimpleNamespace(graph=SimpleNamespace(nodes=(*prog.nodes, other)))
    assert not lane_only_readers(wider, picks[0])  # type: ignore[arg-type]
