"""Chip overrides (`--set`), `chips --show`, and validation naming every bad field at once."""

from __future__ import annotations

import pytest

from hwmodel import ChipConfigError, from_yaml, load_chip, preset_path, with_overrides
from torch2step.cli import main


def test_override_changes_exactly_the_field() -> None:
    base = load_chip("step-sda")
    chip = with_overrides(base, ["hbm.channels=64", "noc.link_bytes_per_cycle=128"])
    assert chip.hbm.channels == 64 and chip.noc.link_bytes_per_cycle == 128.0
    assert chip.core == base.core and chip.num_cores == base.num_cores
    assert chip.name == "step-sda[hbm.channels=64,noc.link_bytes_per_cycle=128]"


def test_mesh_reshape_follows_num_cores_and_ports() -> None:
    chip = with_overrides(load_chip("mesh"), ["noc.rows=4", "noc.cols=4", "hbm.channels=4"])
    assert chip.num_cores == 16 and len(chip.hbm.attach_cores) == 4
    assert all(0 <= c < 16 for c in chip.hbm.attach_cores)


def test_every_bad_field_reported_at_once() -> None:
    with pytest.raises(ChipConfigError) as e:
        with_overrides(
            load_chip("step-sda"), ["hbm.channels=0", "clock_ghz=-1", "core.sram_bytes=1.5"]
        )
    msg = str(e.value)
    assert "3 problems" in msg
    for field in ("hbm.channels = 0", "clock_ghz = -1", "core.sram_bytes = 1.5"):
        assert field in msg


def test_unknown_field_names_the_valid_ones() -> None:
    with pytest.raises(ChipConfigError, match="no field 'hbm.chanels'; fields of hbm: .*channels"):
        with_overrides(load_chip("step-sda"), ["hbm.chanels=4"])
    with pytest.raises(ChipConfigError, match="FIELD=VALUE"):
        with_overrides(load_chip("step-sda"), ["hbm.channels"])


def test_new_dtype_rate_can_be_added() -> None:
    chip = with_overrides(load_chip("step-sda"), ["core.flops_per_cycle.fp8=4096"])
    assert chip.core.flops("fp8") == 4096


def test_chips_show_prints_the_preset_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chips", "--show", "ipu-hbm"]) == 0
    text = capsys.readouterr().out
    assert text == preset_path("ipu-hbm").read_text(encoding="utf-8")
    assert from_yaml(text) == load_chip("ipu-hbm")


def test_chips_show_with_set_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chips", "--show", "step-sda", "--set", "hbm.channels=16"]) == 0
    chip = from_yaml(capsys.readouterr().out)
    assert chip == with_overrides(load_chip("step-sda"), ["hbm.channels=16"])


def test_missing_dtype_rate_is_a_chip_error_naming_the_field() -> None:
    from hwmodel import ChipConfigError

    with pytest.raises(ChipConfigError, match=r"no fp32 compute rate .* core\.flops_per_cycle\.fp32"):
        load_chip("step-sda").core.flops("fp32")


def test_an_edited_copy_of_a_preset_is_labelled_by_its_file(tmp_path) -> None:  # noqa: ANN001
    from hwmodel import load_chip, preset_path

    text = preset_path("step-sda").read_text(encoding="utf-8")
    same = tmp_path / "same.yaml"
    same.write_text(text, encoding="utf-8")
    assert load_chip(same).name == "step-sda"  # the preset itself: its own name
    mine = tmp_path / "mine.yaml"
    mine.write_text(text.replace("channels: 32", "channels: 8", 1), encoding="utf-8")
    chip = load_chip(mine)
    assert chip.hbm.channels == 8 and chip.name == "step-sda[mine.yaml]"


def test_overrides_say_so_in_the_description() -> None:
    from hwmodel import load_chip, with_overrides

    chip = with_overrides(load_chip("step-sda"), ["hbm.channels=64"])
    assert chip.description.endswith("Overridden here: hbm.channels=64.")


def test_every_unknown_field_and_bad_value_is_named_at_once() -> None:
    import pytest

    from hwmodel import ChipConfigError, load_chip, with_overrides

    with pytest.raises(ChipConfigError) as exc:
        with_overrides(load_chip("step-sda"), ["noc.bogus=1", "hbm.nonesuch=2", "hbm.channels=-3"])
    msg = str(exc.value)
    assert "3 problems" in msg and "'noc.bogus'" in msg and "'hbm.nonesuch'" in msg
    assert "hbm.channels = -3" in msg
