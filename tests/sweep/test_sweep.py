"""Sweeps: pool and Ray give identical rows; a killed sweep resumes; --set equals an edited file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hwmodel import load_chip, to_yaml, with_overrides
from torch2step.sweep import ROW_COLUMNS, points, run_sweep

SPEC = {"layers": ["qwen3-moe"], "batches": [1, 2, 3, 4, 5], "tiny": True}


@pytest.fixture(scope="module")
def pool_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("pool")
    return run_sweep(SPEC, out, backend="pool", jobs=2, progress=False)


def test_pool_sweep_writes_rows_and_plots(pool_rows: list[dict], tmp_path: Path) -> None:
    assert len(pool_rows) == 5 and all(r["status"] == "ok" for r in pool_rows)
    assert [r["batch"] for r in pool_rows] == list(range(1, 6))
    assert all(set(r) == set(ROW_COLUMNS) for r in pool_rows)


@pytest.mark.slow  # starts a Ray cluster (~15 s); the pool backend runs in the default suite
def test_ray_gives_identical_rows(pool_rows: list[dict], tmp_path: Path) -> None:
    pytest.importorskip("ray")
    rows = run_sweep(SPEC, tmp_path, backend="ray", jobs=2, progress=False)
    assert rows == pool_rows
    assert (tmp_path / "results.csv").read_text().count("\n") == 6
    for png in ("latency_vs_batch.png", "pareto.png"):
        assert (tmp_path / png).stat().st_size > 10_000


@pytest.mark.slow  # kills and restarts a whole sweep (~15-19 s)
def test_killed_sweep_resumes(tmp_path: Path) -> None:
    # five chips: every point compiles, so the kill lands part way through
    chips = [{"chip": "step-sda", "set": [f"hbm.channels={2**k}"]} for k in range(5)]
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump({"layers": ["qwen3-moe"], "batches": [2], "chips": chips, "tiny": True})
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch2step.cli", "sweep", str(spec), "--out", str(out)]
    cmd += ["--backend", "serial", "-q"]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    cache = out / "points"
    while time.monotonic() < deadline and proc.poll() is None:
        if cache.is_dir() and len(list(cache.glob("*.json"))) >= 2:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = {p: p.stat().st_mtime_ns for p in cache.glob("*.json")}
    assert 2 <= len(done) < 5
    rows = run_sweep(spec, out, backend="pool", jobs=2, progress=False)
    assert all(r["status"] == "ok" for r in rows)
    assert [r["chip"] for r in rows] == [f"step-sda[hbm.channels={2**k}]" for k in range(5)]
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())  # not recomputed
    cached = {json.loads(p.read_text())["hash"] for p in done}
    assert cached <= {r["hash"] for r in rows}
    assert len(list(cache.glob("*.json"))) == 5


def test_failed_point_is_recorded_and_sweep_goes_on(tmp_path: Path) -> None:
    spec = {
        "layers": ["qwen3-moe"],
        "batches": [2],
        "tiny": True,
        "options": [{}, {"tile_rows": 0}],
    }
    rows = run_sweep(spec, tmp_path, backend="serial", progress=False)
    assert [r["status"] for r in rows] == ["ok", "error"]
    assert "tile_rows" in rows[1]["error"]


def test_set_overrides_equal_edited_chip_file(tmp_path: Path) -> None:
    sets = ["hbm.channels=8", "noc.link_bytes_per_cycle=128"]
    edited = with_overrides(load_chip("step-sda"), sets)
    path = tmp_path / "mine.yaml"
    to_yaml(edited, path)
    assert load_chip(path) == edited
    base = {"layers": ["qwen3-moe"], "batches": [4], "tiny": True}
    a = run_sweep(
        {**base, "chips": [{"chip": "step-sda", "set": sets}]},
        tmp_path / "a",
        backend="serial",
        progress=False,
    )
    b = run_sweep({**base, "chips": [str(path)]}, tmp_path / "b", backend="serial", progress=False)
    skip = {"chip", "hash"}
    assert [{k: v for k, v in r.items() if k not in skip} for r in a] == [
        {k: v for k, v in r.items() if k not in skip} for r in b
    ]
    assert a[0]["status"] == "ok"


def test_spec_expansion_and_errors(tmp_path: Path) -> None:
    two = ["qwen3-moe", "llama-gqa"]
    pts = points({"layers": two, "batches": [1, 2], "chips": ["mesh", "step-sda"]})
    assert len(pts) == 8 and pts[0]["layer"] == "qwen3-moe" and pts[0]["chip"] == "mesh"
    from torch2step.errors import InputError

    with pytest.raises(InputError, match="unknown keys"):
        points({"layers": ["qwen3-moe"], "batches": [1], "chip": ["mesh"]})
    # every problem of the spec at once, before any point runs, in the spec's terms
    bad = {
        "layers": ["qwen3-moe", "qwen3-mo"],
        "batches": [0, 8],
        "chips": ["step-sda", "nope", {"chip": "step-sda", "set": ["hbm.channels=-1"]}],
        "options": [{}, {"nosuch": 3}],
    }
    with pytest.raises(InputError) as exc:
        points(bad)
    msg = str(exc.value)
    assert msg.startswith("sweep spec: 5 problems:")
    for want in (
        "layers: 'qwen3-mo' is not a registered layer (did you mean 'qwen3-moe'?)",
        "batches: 0 is not a positive integer",
        "chips: unknown chip preset 'nope'",
        "hbm.channels = -1",
        "options: nosuch: unknown compile option",
    ):
        assert want in msg, msg
    assert json.dumps(pts)  # points are plain data (sent to workers)


@pytest.mark.parametrize(("layer", "batches"), [("qwen3-moe", (3, 5)), ("llama-gqa", (4, 16))])
def test_reused_program_equals_a_fresh_compile(layer: str, batches: tuple[int, int]) -> None:
    from torch2step.named import report_layer

    report_layer(layer, batches[0], tiny=True)  # compiles and keeps the program
    reused = report_layer(layer, batches[1], tiny=True)
    fresh = report_layer(layer, batches[1], tiny=True, reuse=False)
    assert reused.program is not fresh.program
    assert reused.report.to_dict() == {
        **fresh.report.to_dict(),
        "simulation_s": reused.report.simulation_s,
    }


def test_icca_chip_points_run_kernel_by_kernel(tmp_path: Path) -> None:
    # a point on an inter-core-connected chip runs as `torch2step report --chip` does: the
    # full-size layer kernel by kernel; a tiny one is an error row, not a crashed sweep
    from torch2step.cli_compare import kernel_layer_report
    from torch2step.named import report_layer
    from torch2step.sweep import run_point

    base = {"layer": "llama-gqa", "batch": 2, "set": [], "options": {}, "trace": "auto"}
    row = run_point({**base, "chip": "ipu-hbm", "tiny": False})
    assert row["status"] == "ok" and row["execution"] == "kernel", row
    want = kernel_layer_report("llama-gqa", 2, load_chip("ipu-hbm"))
    assert row["latency_cycles"] == want.cycles and row["cores_available"] == 1472
    assert "every request attends 2048 cached rows" in row["notes"]
    tiny = run_point({**base, "chip": "ipu-hbm", "tiny": True})
    assert tiny["status"] == "error" and "set tiny: false" in tiny["error"]
    spatial = run_point({**base, "chip": "step-sda", "tiny": True})
    assert spatial["status"] == "ok" and spatial["execution"] == "spatial"
    # report_layer is the spatial report, on any chip (`report --execution spatial`)
    run = report_layer("llama-gqa", 2, "ipu-hbm", tiny=True)
    assert run.report.latency_cycles > 0 and run.program.execution == "spatial"
