"""Without the mpi extra, every entry point fails with one message naming the extra."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from runtime.mpi import MpiUnavailableError, require_mpi
from runtime.mpi.launch import find_mpiexec
from torch2step.cli import main


@pytest.fixture
def no_mpi4py(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a)
    )
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError


def test_require_mpi_names_the_extra(no_mpi4py):
    with pytest.raises(MpiUnavailableError, match=r"pip install -e '\.\[mpi\]'"):
        require_mpi()
    with pytest.raises(MpiUnavailableError, match=r"install the extra: pip install -e"):
        find_mpiexec()


def test_cli_mpirun_names_the_extra(no_mpi4py, capsys):
    assert main(["mpirun", "cannon", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert "MpiUnavailableError" in err and ".[mpi]" in err
