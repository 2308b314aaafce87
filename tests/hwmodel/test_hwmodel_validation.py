"""Bad chip descriptions: each gives a ChipConfigError naming the field and what is allowed."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import hwmodel
from hwmodel import ChipConfigError


def _mesh_dict() -> dict[str, Any]:
    return hwmodel.to_dict(hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), 2, 2))


def _edit(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    d = copy.deepcopy(_mesh_dict())
    fn(d)
    return d


BAD_FIELDS = [
    # (edit, substrings the message must contain)
    (lambda d: d["noc"].update(link_bytes_per_cycle=-1), ["noc.link_bytes_per_cycle", "positive"]),
    (lambda d: d["noc"].update(link_bytes_per_cycle=0), ["noc.link_bytes_per_cycle"]),
    (lambda d: d["core"].update(sram_bytes="1MB"), ["core.sram_bytes", "integer", "str"]),
    (lambda d: d["core"].update(sram_bytes=1.5), ["core.sram_bytes", "integer"]),
    (lambda d: d["core"].update(fifo_depth=0), ["core.fifo_depth", "positive"]),
    (lambda d: d["core"].update(fifo_depth=True), ["core.fifo_depth", "integer"]),
    (lambda d: d["core"]["flops_per_cycle"].update(bf16=0), ["core.flops_per_cycle.bf16"]),
    (lambda d: d["core"].update(flops_per_cycle={}), ["core.flops_per_cycle", "non-empty"]),
    (lambda d: d["core"].update(flops_per_cycle=[1, 2]), ["core.flops_per_cycle", "mapping"]),
    (lambda d: d["core"].update(kernel_launch_cycles=-3), ["core.kernel_launch_cycles", ">= 0"]),
    (lambda d: d.update(clock_ghz="fast"), ["clock_ghz", "positive number"]),
    (lambda d: d.update(num_cores=5), ["noc.rows x noc.cols", "num_cores = 5"]),
    (lambda d: d["noc"].update(routing="zigzag"), ["noc.routing", "xy, yx"]),
    (lambda d: d["noc"].update(hop_latency_cycles=-1), ["noc.hop_latency_cycles"]),
    (lambda d: d["noc"].update(kind="torus"), ["noc.kind", "mesh, all_to_all"]),
    (lambda d: d["hbm"].update(channels=0), ["hbm.channels", "positive"]),
    (
        lambda d: d["hbm"].update(bytes_per_cycle_per_channel=-2.0),
        ["hbm.bytes_per_cycle_per_channel"],
    ),
    (lambda d: d["hbm"].update(attach_cores=[0, 1]), ["hbm.attach_cores", "hbm.channels = 64"]),
    (
        lambda d: d["hbm"].update(attach_cores=[9] * 64),
        ["hbm.attach_cores[0] = 9", "core id in 0..3"],
    ),
    (lambda d: d["hbm"].update(attach_cores=7), ["hbm.attach_cores", "list of core ids"]),
    (lambda d: d.update(name=""), ["name", "non-empty"]),
    (lambda d: d.update(sources="paper"), ["sources", "list of strings"]),
]


@pytest.mark.parametrize(("edit", "expected"), BAD_FIELDS)
def test_bad_field_names_the_field(edit, expected: list[str]) -> None:
    with pytest.raises(ChipConfigError) as err:
        hwmodel.from_dict(_edit(edit))
    for text in expected:
        assert text in str(err.value)


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ChipConfigError) as err:
        hwmodel.from_dict(_edit(lambda d: d["noc"].update(link_bw=3)))
    msg = str(err.value)
    assert "unknown key noc.link_bw" in msg
    assert "link_bytes_per_cycle" in msg and "hop_latency_cycles" in msg
    with pytest.raises(ChipConfigError, match="unknown key clock_mhz; valid keys: name, clock_ghz"):
        hwmodel.from_dict(_edit(lambda d: d.update(clock_mhz=1000)))


def test_missing_key_is_named() -> None:
    with pytest.raises(ChipConfigError, match="missing required key.*hbm.channels"):
        hwmodel.from_dict(_edit(lambda d: d["hbm"].pop("channels")))
    with pytest.raises(ChipConfigError, match="noc.kind = None"):
        hwmodel.from_dict(_edit(lambda d: d["noc"].pop("kind")))


def test_optional_keys_take_defaults() -> None:
    d = _edit(
        lambda d: [d["core"].pop("fifo_depth"), d["hbm"].pop("attach_cores"), d.pop("sources")]
    )
    chip = hwmodel.from_dict(d)
    assert chip.core.fifo_depth == 2
    assert chip.hbm.attach_cores == ()
    assert chip.sources == ()


def test_integer_bandwidth_becomes_float() -> None:
    chip = hwmodel.from_dict(_edit(lambda d: d["noc"].update(link_bytes_per_cycle=8)))
    assert chip.noc.link_bytes_per_cycle == 8.0
    assert isinstance(chip.noc.link_bytes_per_cycle, float)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ChipConfigError) as err:
        hwmodel.load_chip("ipu")
    msg = str(err.value)
    assert "unknown chip preset 'ipu'" in msg
    assert "ipu-hbm, mesh, sn40l-like, step-paper, step-sda" in msg
    with pytest.raises(ChipConfigError, match="did you mean 'step-sda'"):
        hwmodel.load_chip("step_sda")


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ChipConfigError, match="does not exist"):
        hwmodel.load_chip(tmp_path / "nope.yaml")
    with pytest.raises(ChipConfigError, match="does not exist"):
        hwmodel.load_chip("chips/nope.yaml")


def test_bad_yaml_file_names_file_and_field(tmp_path) -> None:
    text = hwmodel.to_yaml(hwmodel.load_chip("step-sda"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("link_bytes_per_cycle: 64.0", "link_bytes_per_cycle: -64.0"))
    with pytest.raises(ChipConfigError) as err:
        hwmodel.load_chip(bad)
    assert str(bad) in str(err.value)
    assert "noc.link_bytes_per_cycle = -64.0" in str(err.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ChipConfigError, match="not valid YAML"):
        hwmodel.load_chip(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ChipConfigError, match="must be a YAML mapping"):
        hwmodel.load_chip(scalar)


def test_validate_hand_built_chip_lists_every_problem() -> None:
    chip = hwmodel.load_chip("mesh")
    bad = dataclasses.replace(
        chip,
        clock_ghz=0.0,
        core=dataclasses.replace(chip.core, sram_bytes=-1),
        noc=dataclasses.replace(chip.noc, rows=3),
    )
    with pytest.raises(ChipConfigError) as err:
        hwmodel.validate(bad)
    msg = str(err.value)
    assert "3 problems" in msg
    for field in ("clock_ghz", "core.sram_bytes", "noc.rows x noc.cols"):
        assert field in msg
    assert hwmodel.chip_problems(chip) == []
    assert hwmodel.validate(chip) is chip


def test_all_to_all_fields() -> None:
    d = hwmodel.to_dict(hwmodel.load_chip("ipu-hbm"))
    d["noc"]["ejection_bytes_per_cycle"] = 0
    with pytest.raises(ChipConfigError, match="noc.ejection_bytes_per_cycle"):
        hwmodel.from_dict(d)
    d["noc"]["ejection_bytes_per_cycle"] = 4.0
    d["noc"]["rows"] = 2
    with pytest.raises(ChipConfigError, match="unknown key noc.rows.*injection_bytes_per_cycle"):
        hwmodel.from_dict(d)
