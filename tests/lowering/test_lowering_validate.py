"""validate_programs: every rejected program names the core, the instruction and the fix."""

from __future__ import annotations

import dataclasses

import pytest

import hwmodel
import lowering as L
from lowering import ProgramBuilder, ProgramError, affine, region

CHIP = hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), 2, 2)  # 4 cores, 624 KB each


def _pair(send_count: int = 3, recv_count: int = 3) -> ProgramBuilder:
    """Core 0 loads X and sends it ``send_count`` times to core 1, which receives it."""
    b = ProgramBuilder("pair")
    b.tensor("X", (4, 4), "fp32")
    b.tensor("Y", (4, 4), "fp32")
    b.channel("x", 0, 1)
    with b.core(0) as p:
        p.alloc("t", (4, 4), "fp32")
        p.load("t", "X")
        with p.loop(send_count):
            p.send("x", "t")
        p.free("t")
    with b.core(1) as p:
        p.alloc("t", (4, 4), "fp32")
        with p.loop(recv_count):
            p.recv("x", "t")
        p.store("t", "Y")
        p.free("t")
    return b


def _error(b: ProgramBuilder, chip=CHIP) -> str:
    with pytest.raises(ProgramError) as err:
        L.validate_programs(b.build(), chip)
    return str(err.value)


def test_valid_pair_returns_analysis() -> None:
    analysis = L.validate_programs(_pair().build(), CHIP)
    assert analysis.messages_sent("x") == 3
    assert analysis.messages_received("x", 1) == 3
    assert analysis.bytes_sent("x") == 3 * 64
    assert analysis.core(0).peak_sram_bytes == 64
    assert analysis.core(1).peak_buffers == (("t", 64),)


def test_message_count_mismatch() -> None:
    msg = _error(_pair(send_count=4, recv_count=3))
    assert "channel 'x': core 0 sends 4 data message(s) but core 1 receives 3" in msg
    assert "fix the loop counts" in msg


def test_runtime_counts_skip_the_static_check() -> None:
    b = ProgramBuilder("dyn")
    b.tensor("n", (1,), "int32")
    b.channel("x", 0, 1)
    b.channel("cnt", 0, 1)
    with b.core(0) as p:
        p.alloc("t", (2,), "fp32")
        p.compute("zeros", "t", params={"shape": "2"}, dtype="fp32")
        p.load_value("k", "n", (0,))
        p.send_value("cnt", "k")
        with p.loop("k"):
            p.send("x", "t")
        p.free("t")
    with b.core(1) as p:
        p.alloc("t", (2,), "fp32")
        p.recv_value("cnt", "k")
        with p.loop(affine(1, k=1)):  # k + 1 receives: only known at run time
            p.recv("x", "t")
        p.free("t")
    analysis = L.validate_programs(b.build(), CHIP)
    assert analysis.messages_sent("x") is None
    assert analysis.messages_sent("cnt") == 1


def test_send_from_core_that_is_not_the_src() -> None:
    b = _pair()
    b.core(1).send("x", "t")  # after free: also a buffer problem
    msg = _error(b)
    assert "core 1 cannot send on it; send from core 0 or declare a channel with src=1" in msg


def test_recv_by_core_not_among_dsts() -> None:
    b = _pair()
    with b.core(2) as p:
        p.alloc("u", (4, 4), "fp32")
        p.recv("x", "u")
        p.free("u")
    msg = _error(b)
    assert "core 2 is not a destination of channel 'x' (dsts [1])" in msg


def test_declared_channel_nobody_uses() -> None:
    b = _pair()
    b.channel("spare", 2, 3)
    msg = _error(b)
    assert "channel 'spare' (core 2 -> [3]) is declared but no program sends or receives" in msg


def test_send_without_matching_receive() -> None:
    b = _pair()
    b.channel("y", 0, (1, 3))
    b.core(0).alloc("u", (1,), "fp32").compute("zeros", "u", params={"shape": "1"}, dtype="fp32")
    b.core(0).send("y", "u")
    b.core(1).alloc("v", (1,), "fp32").recv("y", "v")
    msg = _error(b)
    assert "destination core 3 never receives from it" in msg
    assert "add a recv on core 3 or remove 3 from dsts" in msg


def test_receive_without_sender() -> None:
    b = _pair()
    b.channel("z", 2, 1)
    b.core(1).alloc("v", (1,), "fp32").recv("z", "v")
    msg = _error(b)
    assert "channel 'z': core 2 (its src) never sends on it" in msg


def test_value_sent_but_data_received() -> None:
    b = ProgramBuilder("kinds")
    b.channel("c", 0, 1)
    b.core(0).send_value("c", 5)
    b.core(1).alloc("t", (1,), "int32").recv("c", "t")
    msg = _error(b)
    assert "core 0 sends 0 data message(s) but core 1 receives 1" in msg
    assert "core 0 sends 1 value message(s) but core 1 receives 0" in msg


def test_unknown_channel_and_cores_out_of_range() -> None:
    b = _pair()
    b.channel("far", 0, 7)
    b.core(0).send("nope", "t")
    b.core(9).barrier("g")
    msg = _error(b)
    assert "channel 'nope' is not declared" in msg
    assert "declared channels: far, x" in msg
    assert "channel 'far': dst core 7 must be in 0..3 (chip 'mesh@2x2' has 4 cores)" in msg
    assert "program for core 9: core id must be in 0..3" in msg


def test_undeclared_tensor_buffer_and_register() -> None:
    b = ProgramBuilder("refs")
    b.tensor("X", (4,), "fp32")
    with b.core(0) as p:
        p.load("t", "X")  # t not allocated
        p.alloc("t", (4,), "fp32")
        p.load("t", "W")  # W not declared
        p.load("t", "X", region(("r",), (2,)))  # r undefined
        p.free("t")
        p.store("t", "X")  # used after free
    msg = _error(b)
    assert "core 0, instr 1 `load t <- X`: buffer 't' is not allocated here" in msg
    assert "instr 3 `load t <- W`: tensor 'W' is not declared" in msg
    assert "register 'r' is read before it is defined" in msg
    assert "instr 6 `store X <- t`: buffer 't' is not allocated here" in msg


def test_register_defined_in_one_arm_only() -> None:
    b = ProgramBuilder("arms")
    with b.core(0) as p:
        p.set("a", 1)
        with p.if_("a", "==", 1):
            p.set("b", 2)
        p.set("c", "b")
    msg = _error(b)
    assert "instr 3 `set c = b`: register 'b' is read before it is defined" in msg


def test_double_alloc_free_unallocated_and_loop_leak() -> None:
    b = ProgramBuilder("bufs")
    with b.core(0) as p:
        p.alloc("t", (2,), "fp32")
        p.alloc("t", (2,), "fp32")
        p.free("u")
        with p.loop(2):
            p.alloc("tmp", (2,), "fp32")
    msg = _error(b)
    assert "buffer 't' is already allocated; free it first" in msg
    assert "buffer 'u' is not allocated; remove this free" in msg
    assert "allocated and not freed: ['tmp']" in msg


def test_sram_overflow_reports_peak_buffers_and_fix() -> None:
    b = ProgramBuilder("big")
    with b.core(0) as p:
        p.alloc("w", (256, 512), "fp32")  # 512 KiB
        p.alloc("x", (128, 256), "fp32")  # 128 KiB
        p.free("x")
        p.free("w")
        p.alloc("y", (16,), "fp32")
    msg = _error(b)
    assert "core 0 needs 655360 bytes of SRAM at its peak" in msg
    assert "w (524288 B), x (131072 B)" in msg
    assert "core.sram_bytes = 638976" in msg
    assert "use smaller tiles, free buffers earlier, or spread the work over more cores" in msg
    roomy = dataclasses.replace(CHIP, core=dataclasses.replace(CHIP.core, sram_bytes=1 << 20))
    assert L.validate_programs(b.build(), roomy).core(0).peak_sram_bytes == 655360


def test_peak_counts_the_larger_branch() -> None:
    b = ProgramBuilder("branches")
    with b.core(0) as p:
        p.set("n", 1)
        with p.if_("n", ">", 0):
            p.alloc("big", (1000,), "fp32")
            p.free("big")
        with p.else_():
            p.alloc("small", (10,), "fp32")
            p.free("small")
    assert L.validate_programs(b.build(), CHIP).core(0).peak_sram_bytes == 4000


def test_unknown_kernel_and_dtype_without_flops() -> None:
    b = ProgramBuilder("kern")
    with b.core(0) as p:
        p.alloc("t", (2, 2), "fp32")
        p.compute("softmaxx", "t", "t", dtype="fp32")
        p.compute("copy", "t", "t", dtype="int8")
    msg = _error(b)
    assert "unknown kernel 'softmaxx'; registered kernels:" in msg
    assert "matmul_acc" in msg
    assert "core 0 computes in int8 but chip 'mesh@2x2' has no core.flops_per_cycle entry" in msg
    assert "(has: bf16, fp16, fp32)" in msg


def test_region_bounds_rank_and_capacity() -> None:
    b = ProgramBuilder("regions")
    b.tensor("X", (4, 4), "fp32")
    with b.core(0) as p:
        p.alloc("t", (2, 2), "fp32")
        p.load("t", "X", region((3, 0), (2, 2)))
        p.load("t", "X", region((0,), (2,)))
        p.load("t", "X")
    msg = _error(b)
    assert "region [3:5] of dimension 0 is outside tensor 'X' (size 4)" in msg
    assert "region has 1 starts / 1 extents but tensor 'X' has rank 2" in msg
    assert "moves 16 elements into buffer 't' of capacity 4" in msg


def test_load_value_needs_integer_tensor() -> None:
    b = ProgramBuilder("lv")
    b.tensor("F", (3,), "bf16")
    b.core(0).load_value("n", "F", (0,))
    assert "load_value reads control values from integer tensors; 'F' is bf16" in _error(b)


def test_barriers() -> None:
    b = ProgramBuilder("bar")
    b.barrier_group("g", (0, 1, 2))
    b.barrier_group("unused", (0,))
    b.core(0).barrier("g").barrier("g")
    b.core(1).barrier("g")
    b.core(2).set("x", 0)
    b.core(3).barrier("g").barrier("h")
    msg = _error(b)
    assert "core 3 is not a member of barrier group 'g'" in msg
    assert "barrier group 'h' is not declared (declared groups: g, unused)" in msg
    assert "barrier group 'g': core 2 never arrives" in msg
    assert "members arrive different numbers of times (core 0: 2, core 1: 1, core 2: 0)" in msg
    assert "barrier group 'unused' is declared but no member executes `barrier unused`" in msg


def test_barrier_member_without_program() -> None:
    b = ProgramBuilder("bar2")
    b.barrier_group("g", (0, 3))
    b.core(0).barrier("g")
    assert "includes core 3, which has no program" in _error(b)


def test_declaration_problems() -> None:
    ps = L.ProgramSet(
        programs=(L.Program(0, ()), L.Program(0, ())),
        channels=(L.Channel("c", 0, ()), L.Channel("d", 1, (1, 2, 2), depth=0)),
        tensors=(L.TensorDecl("T", (0,), "fp8"),),
        name="decl",
    )
    with pytest.raises(ProgramError) as err:
        L.validate_programs(ps, CHIP)
    msg = str(err.value)
    assert "core 0 has 2 programs" in msg
    assert "channel 'c' has no destination" in msg
    assert "channel 'd' lists a destination twice" in msg
    assert "channel 'd' sends from core 1 to itself" in msg
    assert "channel 'd': depth 0 must be >= 1" in msg
    assert "tensor 'T': unknown dtype 'fp8'" in msg
    assert "tensor 'T': shape [0] must be positive integers" in msg


def test_single_problem_message_is_one_line() -> None:
    b = _pair()
    b.channel("spare", 2, 3)
    msg = _error(b)
    assert msg.startswith("program set 'pair': channel 'spare'")
    assert "\n" not in msg
