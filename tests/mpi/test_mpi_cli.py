"""``torch2step mpirun`` runs a dataflow on MPI ranks, writes outputs and timings, checks them
against the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.mpi.bundle import dataflow_bundle, save_bundle
from runtime.mpi.launch import mpi_available
from torch2step.cli import main

REASON = mpi_available()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the mpi extra is not installed: {REASON}"
)


def test_mpirun_dataflow_with_check(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["mpirun", "pumma", "--size", "16x16x16", "--grid", "2x4", "-n", "2"]
    assert main([*argv, "--check", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "equal to the simulator's functional mode bit for bit" in text
    result = json.loads((out / "0" / "result.json").read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    with np.load(out / "0" / "outputs.npz") as z:
        assert z["C"].shape == (16, 16)


def test_mpirun_bundle_file(tmp_path, capsys):
    path = save_bundle(dataflow_bundle("cannon", 8, 8, 8, (2, 2)), tmp_path / "c.pkl")
    assert main(["mpirun", str(path), "-n", "2", "--out", str(tmp_path / "o")]) == 0
    assert "cannon_matmul" in capsys.readouterr().out


def test_mpirun_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["mpirun", "nosuch", "-n", "2"])
    assert e.value.code == 2
    assert "neither a bundle file, a dataflow" in capsys.readouterr().err


def test_a_file_that_is_no_bundle_is_one_error(tmp_path):
    from runtime.mpi.bundle import load_bundle
    from runtime.mpi.errors import MpiError

    bad = tmp_path / "bad.pkl"
    bad.write_text("garbage\n")
    with pytest.raises(MpiError, match="not a program bundle"):
        load_bundle(bad)
