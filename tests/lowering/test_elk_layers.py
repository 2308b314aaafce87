"""Equal stacked layers emitted once and copied (lowering.elk_layers, ELK §4.4 identical layers):
the program set is exactly the one of the full emission (and simulates the same) for timing
stacks (shapes only) and for stacks with weights; and the renaming it relies on; and the
placement that makes full-size layers copies: the same cores for the same operator of every
layer whenever they fit (lowering.elk_placement)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch2step  # noqa: E402
import torch2step.kernel.stack as stack  # noqa: E402
from lowering import elk_layers  # noqa: E402
from lowering.elk_flow import Flow  # noqa: E402
from lowering.elk_layers import Renamer  # noqa: E402
from lowering.elk_programs import elk_programs  # noqa: E402
from lowering.errors import ProgramError  # noqa: E402
from lowering.isa import Alloc, Compute, Free, Load, ProgramSet, Recv, Send  # noqa: E402
from models.decoder import tiny_config_dict  # noqa: E402
from runtime import Simulator, simulate  # noqa: E402
from runtime.program_layers import OpCall, _local  # noqa: E402


def _both(prog, layers: int, monkeypatch: pytest.MonkeyPatch) -> tuple[ProgramSet, ProgramSet]:
    """The program set of the first ``layers`` layers built with copies and without."""
    copied: list[int] = []
    find = elk_layers.find_layering

    def spy(*args, **kwargs):
        lay = find(*args, **kwargs)
        copied.append(0 if lay is None else lay.copies)
        return lay

    monkeypatch.setattr("lowering.elk_programs.find_layering", spy)
    layered = prog.programs(layers)
    assert copied and copied[-1] > 0, "no section was copied"
    monkeypatch.setattr(stack, "elk_programs", lambda *a, **k: elk_programs(*a, layers=False, **k))
    return layered, prog.programs(layers)


# The layer copies do not depend on the design; ELK-Dyn plans these tiny stacks without
# ELK-Full's search over preload orders (most of the time where the whole model fits on chip).


def test_copied_layers_are_the_full_emission(tmp_path, monkeypatch) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("llama", num_hidden_layers=6)))
    prog = torch2step.compile_config(
        path, batch=2, past=8, layers=5, chip="ipu-hbm", design="elk_dyn"
    )
    layered, full = _both(prog, 4, monkeypatch)
    assert layered == full
    assert [p.core for p in layered.programs] == [p.core for p in full.programs]
    assert layered.copies and not hasattr(full, "copies")
    # the controller (the last core: go_i / done_i tokens, ELK §4.5) copies its sections too
    assert prog.chip.num_cores - 1 in layered.copies
    a, b = simulate(layered, prog.chip, trace=True), simulate(full, prog.chip, trace=True)
    assert a.cycles == b.cycles > 0 and a.stats.to_dict() == b.stats.to_dict()
    assert a.trace_json() == b.trace_json()


def test_copied_layers_compile_once_and_replay(tmp_path, monkeypatch) -> None:
    """The copies run from their template's operations (runtime.program_layers): fewer
    operations compiled, the same run, also after an untimed replay borrowed them."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config_dict("llama", num_hidden_layers=6)))
    prog = torch2step.compile_config(
        path, batch=2, past=8, layers=5, chip="ipu-hbm", design="elk_dyn"
    )
    layered, full = _both(prog, 5, monkeypatch)
    sa, sb = Simulator(layered, prog.chip), Simulator(full, prog.chip)
    ca, cb = sa._compiled, sb._compiled
    assert ca is not None and cb is not None and ca.templates
    calls = sum(op.__class__ is OpCall for c in ca.cores for op in c.code)
    assert calls > 0
    assert sum(len(c.code) for c in ca.cores) < sum(len(c.code) for c in cb.cores) - calls
    # a copy's tile buffers (allocated and freed in its section) are its template's objects
    for c in ca.cores:
        assert len(c.bufs) <= len(cb.cores[c.id].bufs)
    assert sum(len(c.bufs) for c in ca.cores) < sum(len(c.bufs) for c in cb.cores)
    sa.replay().close()  # runs every copy, then hands the programs back bound to layer 1
    a, b = sa.run(), sb.run()
    assert a.cycles == b.cycles > 0 and a.stats.to_dict() == b.stats.to_dict()


def test_copied_layers_with_weights_are_the_full_emission(monkeypatch, tiny_llama_stack) -> None:
    g, x, k, v = tiny_llama_stack(4)
    import torch

    ks, vs = torch.stack([k, k + 1, k - 1, 2 * k]), torch.stack([v, -v, v * 2, v + 3])
    prog = torch2step.compile(g, (x, ks, vs), chip="ipu-hbm", design="elk_dyn")
    layered, full = _both(prog, 4, monkeypatch)
    assert layered == full
    inputs = prog._bound((x, ks, vs))
    a = simulate(layered, prog.chip, mode="functional", inputs=inputs)
    b = simulate(full, prog.chip, mode="functional", inputs=inputs)
    assert a.cycles == b.cycles and sorted(a.tensors) == sorted(b.tensors)
    assert all((a.tensors[t] == b.tensors[t]).all() for t in a.tensors)


def test_section_local_buffers_are_those_allocated_and_freed_inside() -> None:
    body = (
        Alloc("o4_w0", (2, 2)),  # freed later: outlives the range
        Alloc("o3_a0", (2, 2)),
        Recv("c0", "o3_a0"),
        Compute("matmul", ("o3_p",), ("o3_a0", "o4_w0")),  # o3_p: not allocated here
        Free("o3_a0"),
        Alloc("o3_a0", (2, 2)),  # allocated again, freed again: still local
        Free("o3_a0"),
        Alloc("o3_s", (2, 2)),
        Free("o3_s"),
        Send("c1", "o3_s"),  # a use after the Free: not local
    )
    assert _local(body, 0, len(body)) == {"o3_a0"}
    assert _local(body, 1, 6) == {"o3_a0"}
    assert _local(body, 2, 3) == set()  # the Alloc is outside the range


def test_renamer_shifts_operator_names_and_refuses_others() -> None:
    flow = Flow({})
    flow.names = {(3, 4, 7, 9): ["a3_4_7_9_0"], (13, 14, 7, 9): ["a13_14_7_9_5"]}
    ren = Renamer(10, 1, flow)
    assert ren.name("o4_w0") == "o14_w0"
    assert ren.name("o4_x_g2") == "o14_x_g2"
    assert ren.name("go5") == "go15" and ren.name("done5_12") == "done15_12"
    assert ren.name("a3_4_7_9_0") == "a13_14_7_9_5"
    assert ren.tensor("L2.n1_linear.w") == "L3.n1_linear.w" and ren.tensor("cos") == "cos"
    assert ren.instr(Load("o4_w0", "L2.w", None)) == Load("o14_w0", "L3.w", None)
    assert ren.instr(Recv("a3_4_7_9_0", "o4_x_g0")) == Recv("a13_14_7_9_5", "o14_x_g0")
    with pytest.raises(ProgramError, match="not a name of an ELK program"):
        ren.name("tmp")
    with pytest.raises(ProgramError, match="no piece"):
        Renamer(20, 2, flow).name("a3_4_7_9_0")


@pytest.mark.parametrize("chip_name", ["ipu-hbm", "mesh"])
def test_full_size_identical_layers_are_placed_alike(chip_name: str) -> None:
    # least-loaded placement alone moves a layer's operators to other cores from layer to
    # layer (what the previous layers left resident differs); an operator takes the cores of
    # the same operator a layer earlier when it fits there, so the programs are copies (layer
    # 1 may still move where layer 0's cores are taken: layer 0 follows no resident layer)
    from elk.ops import decode_step_ops
    from elk.plan import plan_model
    from hwmodel.presets import load_chip
    from lowering.elk_placement import core_peaks, place

    chip = load_chip(chip_name)
    ops = decode_step_ops("llama3-8b", 32, 2048, 4)
    s = plan_model(ops, chip, "elk_dyn")
    placed = place(chip, ops, s.plans, s.order, s.issued)
    size = len(ops) // 4
    moved = [j for j in range(2 * size, len(ops)) if placed[j].cores != placed[j - size].cores]
    assert not moved, f"operators {moved} moved to other cores than a layer earlier"
    assert core_peaks(chip, ops, s.plans, s.order, s.issued).max() <= chip.core.sram_bytes
