"""Launch program bundles on ``n`` MPI ranks from an ordinary Python process.

:func:`launch` writes the bundles, runs ``mpiexec -n N python -m runtime.mpi ...`` (the
``mpiexec`` of the ``mpi`` extra's MPI wheel, found next to the running Python first) with one
BLAS thread per rank, and reads back each bundle's outputs, per-rank statistics or error.  The
whole launch has a wall-clock limit; past it the ``mpiexec`` process group is killed and
:class:`MpiError` says so — a launch never hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import DeadlockError, SimulationError
from runtime.mpi.bundle import Bundle, save_bundle
from runtime.mpi.errors import INSTALL_HINT, MpiError, MpiUnavailableError
from runtime.mpi.run import RankStats

__all__ = ["Launched", "launch", "find_mpiexec", "mpi_available"]

_ERRORS = {"deadlock": DeadlockError, "simulation": SimulationError, "mpi": MpiError}


@dataclass(frozen=True)
class Launched:
    """One bundle's run: outputs, per-rank statistics and wall seconds, or the error."""

    name: str
    ranks_n: int
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    ranks: tuple[RankStats, ...] = ()
    wall_s: float = 0.0
    error_kind: str | None = None
    error: str | None = None
    out_dir: Path | None = None

    def check(self) -> Launched:
        """Raise the run's error (:class:`~runtime.DeadlockError`, ...) if it failed."""
        if self.error is not None:
            raise _ERRORS.get(self.error_kind or "mpi", MpiError)(self.error)
        return self

    def bytes_moved(self) -> dict[str, int]:
        """HBM and message bytes of all ranks, keyed as ``SimStats.bytes_moved``."""
        keys = ("hbm_read", "hbm_write", "noc_messages")
        return {k: sum(getattr(r, k) for r in self.ranks) for k in keys}


def find_mpiexec() -> str:
    """The ``mpiexec`` to use, or :class:`MpiUnavailableError` naming the extra."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        raise MpiUnavailableError(
            f"the MPI backend needs mpi4py and an MPI library; install the extra: {INSTALL_HINT}"
        )
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise MpiUnavailableError(
            f"no mpiexec next to {sys.executable} or on PATH; install an MPI library with the "
            f"extra: {INSTALL_HINT}"
        )
    return found


def mpi_available() -> str | None:
    """None when MPI launches can work here, else the reason they cannot."""
    try:
        find_mpiexec()
    except MpiUnavailableError as exc:
        return str(exc)
    return None


def _oversubscribe(mpiexec: str) -> list[str]:
    """Open MPI refuses more ranks than cores (and running as root) unless told; MPICH's
    Hydra does not."""
    try:
        text = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    if "Open MPI" not in text and "OpenRTE" not in text:
        return []
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    return ["--oversubscribe", *(["--allow-run-as-root"] if root else [])]


def launch(
    bundles: Sequence[Bundle | str | Path],
    n: int,
    *,
    timeout: float | Sequence[float] = 10.0,
    out: str | Path | None = None,
    wall_limit: float | None = None,
) -> list[Launched]:
    """Run each bundle on ``n`` ranks (one ``mpiexec``); ``timeout``: seconds without progress
    that make a deadlock (one for all bundles or one per bundle); ``out``: keep outputs there (default: a temporary directory);
    ``wall_limit``: seconds for the whole launch (default grows with the bundles)."""
    if n < 1:
        raise MpiError(f"-n {n}: the number of ranks must be at least 1")
    mpiexec = find_mpiexec()
    tmp = tempfile.TemporaryDirectory(prefix="t2s-mpi-")
    try:
        work = Path(tmp.name)
        outdir = Path(out) if out is not None else work / "out"
        paths = []
        for k, b in enumerate(bundles):
            if isinstance(b, Bundle):
                paths.append(str(save_bundle(b, work / f"bundle{k}.pkl")))
            else:
                paths.append(str(b))
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        cmd = [mpiexec, *_oversubscribe(mpiexec), "-n", str(n), sys.executable, "-m"]
        times = (
            [float(timeout)] * len(paths) if isinstance(timeout, (int, float)) else list(timeout)
        )
        if len(times) != len(paths):
            raise MpiError(f"{len(times)} timeouts for {len(paths)} bundles; give one per bundle")
        cmd += ["runtime.mpi", *paths, "--out", str(outdir)]
        cmd += ["--timeout", ",".join(repr(t) for t in times)]
        limit = wall_limit if wall_limit is not None else 60 + sum(3 * t + 30 for t in times)
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            _, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise MpiError(
                f"mpiexec -n {n} did not finish within {limit:g} s and was stopped; raise "
                "wall_limit for long runs"
            ) from None
        results = []
        for k in range(len(paths)):
            res_file = outdir / str(k) / "result.json"
            if not res_file.exists():
                tail = err.decode(errors="replace").strip().splitlines()[-15:]
                raise MpiError(
                    f"mpiexec -n {n} exited with status {proc.returncode} before writing the "
                    f"result of {paths[k]}:\n" + "\n".join(tail)
                )
            results.append(_read(outdir / str(k), out is not None))
        return results
    finally:
        tmp.cleanup()


def _read(d: Path, keep: bool) -> Launched:
    r = json.loads((d / "result.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    if (d / "outputs.npz").exists():
        with np.load(d / "outputs.npz") as z:
            tensors = {k: z[k] for k in z.files}
    err = r.get("error") or {}
    return Launched(
        r.get("name", r["bundle"]),
        r["ranks_n"],
        tensors,
        tuple(RankStats(**{**s, "cores": tuple(s["cores"])}) for s in r.get("ranks", ())),
        r.get("wall_s", 0.0),
        err.get("kind"),
        err.get("message"),
        d if keep else None,
    )
