"""Shipped chip presets: load, validate, round-trip through YAML, carry their cited figures."""

from __future__ import annotations

import re

import pytest

import hwmodel
from hwmodel import AllToAllNoC, MeshNoC

PRESETS = ["ipu-hbm", "mesh", "sn40l-like", "step-paper", "step-sda"]


def test_list_presets() -> None:
    assert hwmodel.list_presets() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_exactly(name: str, tmp_path) -> None:
    chip = hwmodel.load_chip(name)
    assert chip.name == name
    text = hwmodel.to_yaml(chip)
    assert hwmodel.from_yaml(text) == chip
    path = tmp_path / f"{name}.yaml"
    assert hwmodel.to_yaml(chip, path) == text
    again = hwmodel.load_chip(path)
    assert again == chip
    assert hwmodel.to_yaml(again) == text
    assert hwmodel.from_dict(hwmodel.to_dict(chip)) == chip
    assert hwmodel.load_chip(chip) is chip


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_value_cites_a_source(name: str) -> None:
    """Each numeric value carries a comment on its line or on the comment block just above."""
    lines = hwmodel.preset_path(name).read_text().splitlines()
    for n, line in enumerate(lines):
        if re.match(r"^\s*[a-z_0-9]+:\s*[-\d\[]", line):
            above = lines[n - 1].strip() if n else ""
            assert "#" in line or above.startswith("#"), f"{name}: no source for {line!r}"
    assert hwmodel.load_chip(name).sources


def test_step_sda_figures_from_seed_000() -> None:
    chip = hwmodel.load_chip("step-sda")
    assert chip.core.sram_bytes_per_cycle == 64
    assert chip.hbm.bytes_per_cycle == 1024
    assert chip.hbm.channels == 32
    assert chip.core.flops("bf16") == 2048
    assert chip.core.sram_bytes == 512 * 1024
    assert isinstance(chip.noc, MeshNoC)
    assert chip.noc.rows * chip.noc.cols == chip.num_cores == 1040
    assert chip.hbm.attach_cores == ()


def test_ipu_hbm_figures_from_seed_002() -> None:
    chip = hwmodel.load_chip("ipu-hbm")
    assert chip.num_cores == 1472
    assert chip.core.sram_bytes == 624 * 1024
    assert chip.core.sram_bytes_per_cycle == 16  # 128 bits/cycle
    assert isinstance(chip.noc, AllToAllNoC)
    link_gb_s = chip.noc.injection_bytes_per_cycle * chip.clock_ghz
    assert link_gb_s == pytest.approx(5.5, rel=1e-3)
    hbm_tb_s = chip.hbm.bytes_per_cycle * chip.clock_ghz / 1000
    assert hbm_tb_s == pytest.approx(4.0, rel=1e-3)  # 16 TB/s over 4 chips
    total_tflops = chip.core.flops("fp16") * chip.num_cores * chip.clock_ghz / 1000
    assert total_tflops == pytest.approx(250, rel=0.01)


def test_sn40l_like_figures() -> None:
    chip = hwmodel.load_chip("sn40l-like")
    assert chip.num_cores == 1040
    assert chip.core.sram_bytes * chip.num_cores == 520 * 1024 * 1024  # 520 MB on chip
    assert chip.hbm.bytes_per_cycle * chip.clock_ghz == pytest.approx(1600)
    tflops = chip.core.flops("bf16") * chip.num_cores * chip.clock_ghz / 1000
    assert tflops == pytest.approx(638, rel=0.01)
    assert chip.hbm.attach_cores == hwmodel.edge_attach_cores(26, 40, 32)


def test_mesh_preset_is_the_elk_mesh_variant() -> None:
    mesh, ipu = hwmodel.load_chip("mesh"), hwmodel.load_chip("ipu-hbm")
    assert mesh.core == ipu.core
    assert mesh.num_cores == ipu.num_cores
    assert mesh.hbm.bytes_per_cycle == ipu.hbm.bytes_per_cycle
    assert isinstance(mesh.noc, MeshNoC)
    assert mesh.noc.link_bytes_per_cycle == ipu.noc.injection_bytes_per_cycle
    assert mesh.hbm.attach_cores == hwmodel.edge_attach_cores(32, 46, 64)
    cols = {mesh.mesh_coords(c)[1] for c in mesh.hbm.attach_cores}
    assert cols == {0, 45}


def test_mesh_coordinates() -> None:
    chip = hwmodel.load_chip("mesh")
    assert chip.mesh_coords(47) == (1, 1)
    assert chip.core_at(1, 1) == 47
    assert all(chip.core_at(*chip.mesh_coords(c)) == c for c in range(0, 1472, 97))
    with pytest.raises(hwmodel.ChipConfigError, match="outside the 32x46 mesh"):
        chip.core_at(32, 0)
    with pytest.raises(hwmodel.ChipConfigError, match="all-to-all"):
        hwmodel.load_chip("ipu-hbm").mesh_coords(0)


def test_with_mesh_shape() -> None:
    small = hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), 4, 4)
    assert small.num_cores == 16
    assert small.name == "mesh@4x4"
    assert (small.noc.rows, small.noc.cols) == (4, 4)
    assert small.hbm.attach_cores == hwmodel.edge_attach_cores(4, 4, 64)
    assert hwmodel.from_yaml(hwmodel.to_yaml(small)) == small
    with pytest.raises(hwmodel.ChipConfigError, match="all-to-all"):
        hwmodel.with_mesh_shape(hwmodel.load_chip("ipu-hbm"), 2, 2)


def test_edge_attach_cores() -> None:
    assert hwmodel.edge_attach_cores(4, 4, 4) == (4, 12, 7, 15)
    assert hwmodel.edge_attach_cores(2, 1, 2) == (0, 1)
    assert len(hwmodel.edge_attach_cores(32, 46, 64)) == 64
