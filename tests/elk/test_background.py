"""Background traffic at an all-to-all ejection port (runtime.network: ELK §3.2, §4.3 preload
and execute traffic share the interconnect's bandwidth; the port serves execute traffic ahead
of preload pieces, preemptive-resume at packet granularity, modelled as fluid).

Chip (tests/runtime/runtime_testkit.a2a_chip): ports 8 B/cycle, exchange latency 10; HBM 4
channels x 32 B/cycle, latency 100."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from runtime_testkit import a2a_chip, hbm  # noqa: E402

from lowering.isa import (  # noqa: E402
    Alloc,
    Channel,
    Load,
    Program,
    ProgramSet,
    Recv,
    Send,
    Store,
    TensorDecl,
)
from lowering.printer import format_program  # noqa: E402
from runtime import simulate  # noqa: E402

PRE = 8192  # bf16 elements preloaded by core 0: 16 KiB, 2048 cycles of its port
MSG = 512  # bf16 elements core 1 sends it: 1 KiB, 128 cycles of a port


def _programs(background: bool, send: bool = True) -> ProgramSet:
    """Core 0 preloads ``p`` (a background read or an ordinary one), receives ``s`` from core 1
    and stores it; core 1 sends ``s`` at cycle 0."""
    recv = (Alloc("s", (MSG,)), Recv("c", "s"), Store("s", "out")) if send else ()
    p0 = Program(0, (Alloc("p", (PRE,)), Load("p", "w", None, background), *recv))
    progs = (p0,)
    if send:
        progs += (Program(1, (Alloc("s", (MSG,)), Send("c", "s"))),)
    return ProgramSet(
        progs,
        channels=(Channel("c", 1, (0,)),) if send else (),
        tensors=(TensorDecl("w", (PRE,)), TensorDecl("out", (MSG,))),
    )


def test_execute_message_passes_a_queued_preload():
    # ordinary (first come first served): the load holds core 0's port [0, 2048) and its
    # channels end with it (2048 + 110 = 2158); the message's ejection waits for the port,
    # [2048, 2176), the store then takes the injection port [2176, 2304) and ends 10 + 100
    # cycles after: 2414
    fcfs = simulate(_programs(False), a2a_chip(2))
    assert fcfs.cycles == 2414
    # background: the message's ejection takes [10, 138) (its tail leaves core 1's port at
    # 128), the store ends at 138 + 128 + 10 + 100 = 376; the preload's port slot is pushed
    # back by those 128 cycles, 2048 + 128, and completes 110 cycles after: 2286
    bg = simulate(_programs(True), a2a_chip(2))
    assert bg.cycles == 2176 + 110
    # the port carried the same bytes in the same busy cycles (work conserving)
    for r in (fcfs, bg):
        assert dict(r.stats.bytes_moved)["hbm_read"] == 2 * PRE


def test_background_read_alone_is_timed_as_an_ordinary_one():
    # no execute traffic: the port slot [0, 2048), the channels [0, 128): done at 2048 + 110
    for background in (False, True):
        assert simulate(_programs(background, send=False), a2a_chip(1)).cycles == 2048 + 110


@pytest.mark.parametrize("background", [False, True])
def test_background_flag_is_printed(background):
    text = format_program(_programs(background, send=False).programs[0])
    assert ("(background)" in text) == background


def _hbm_programs(background: bool) -> ProgramSet:
    """Core 0 preloads ``p`` (background or ordinary); core 1 reads ``s`` from HBM at the same
    cycle, an ordinary read, and stores it back."""
    p0 = Program(0, (Alloc("p", (PRE,)), Load("p", "w", None, background)))
    p1 = Program(1, (Alloc("s", (MSG,)), Load("s", "x"), Store("s", "out")))
    return ProgramSet(
        (p0, p1),
        tensors=(TensorDecl("w", (PRE,)), TensorDecl("x", (MSG,)), TensorDecl("out", (MSG,))),
    )


def test_execute_hbm_read_passes_queued_preload_requests():
    # HBM of 4 channels x 1 B/cycle (slower than the 8 B/cycle ports).  Ordinary: core 0's 16
    # KiB take every channel 4096 cycles first, core 1's 1 KiB (256 B per channel) follows:
    # read done at 4096 + 256 + 110; its store reaches the channels 10 cycles later, takes
    # 256 cycles there and ends 100 cycles after
    chip = a2a_chip(2, mem=hbm(channels=4, bw=1.0))
    fcfs = simulate(_hbm_programs(False), chip)
    store = 10 + 256 + 100
    assert fcfs.stats.core(1).finish == 4096 + 256 + 110 + store
    assert fcfs.stats.core(0).finish == 4096 + 110
    # background: core 1's read and store are served first; the preload takes the pooled
    # channels' 4 B/cycle in the cycles they leave: 4096 + 2 * 256, done 110 cycles later
    bg = simulate(_hbm_programs(True), chip)
    assert bg.stats.core(1).finish == 256 + 110 + store
    assert bg.cycles == bg.stats.core(0).finish == 4096 + 2 * 256 + 110
    # the channels were busy as long in both runs (the preload's cycles added per channel)
    assert [c.busy for c in bg.stats.hbm_channels] == [c.busy for c in fcfs.stats.hbm_channels]
