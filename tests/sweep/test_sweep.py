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


def _chip_sweep(tmp_path: Path, n: int) -> tuple[Path, Path, list[str]]:
    """A spec of the tiny qwen3-moe at batch 2 on ``n`` step-sda chips of different HBM
    channel counts (every point compiles), its output folder and the command sweeping it."""
    chips = [{"chip": "step-sda", "set": [f"hbm.channels={2**k}"]} for k in range(n)]
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump({"layers": ["qwen3-moe"], "batches": [2], "chips": chips, "tiny": True})
    )
    out = tmp_path / "out"
    return (
        spec,
        out,
        [sys.executable, "-m", "torch2step.cli", "sweep", str(spec), "--out", str(out)],
    )


@pytest.mark.slow  # kills and restarts a whole sweep (~15-19 s)
def test_killed_sweep_resumes(tmp_path: Path) -> None:
    # five chips: every point compiles, so the kill lands part way through
    spec, out, cmd = _chip_sweep(tmp_path, 5)
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


def test_spec_options_take_strategy_options_and_key_value_lists(tmp_path: Path) -> None:
    # every option a spatial compile takes, typed; an option set also as KEY=VALUE strings
    spec = {
        "layers": ["qwen3-moe"],
        "batches": [2],
        "tiny": True,
        "options": [["moe_lane_assign=consecutive", "moe_lanes=2"], {"strategy": "default"}],
    }
    pts = points(spec)
    assert [p["options"] for p in pts] == [
        {"moe_lane_assign": "consecutive", "moe_lanes": 2},
        {"strategy": "default"},
    ]
    rows = run_sweep(spec, tmp_path, backend="serial", progress=False)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert json.loads(rows[0]["options"]) == {"moe_lane_assign": "consecutive", "moe_lanes": 2}


def test_spec_refuses_bad_forms_all_at_once(tmp_path: Path) -> None:
    from torch2step.errors import InputError

    base = {"layers": ["llama-gqa"], "batches": [4]}
    with pytest.raises(InputError) as exc:  # an option set given as a list of a pair
        points({**base, "options": [["tile_rows", 32]]})
    assert str(exc.value) == (
        "sweep spec: options: ['tile_rows', 32] is not an option set; an option set is a "
        "mapping {tile_rows: 32} or a list of KEY=VALUE strings [tile_rows=32]"
    )
    with pytest.raises(InputError, match="options: .* is not a list of option sets"):
        points({**base, "options": {"tile_rows": 32}})
    # one chip or trace written without the list brackets: not read letter by letter
    with pytest.raises(InputError, match=r"chips must be a list \(e.g. chips: \[step-sda\]\)"):
        points({**base, "chips": "step-sda"})
    with pytest.raises(InputError, match=r"traces must be a list"):
        points({**base, "traces": "auto"})
    # tiny must be a YAML boolean; kernel chips take neither tiny nor STeP options: before
    # any point runs, with the other problems
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "layers: [llama-gqa]\nbatches: [4]\nchips: [step-sda, ipu-hbm, "
        "{chip: mesh, set: [hbm.channels=8]}]\noptions: [{}, {tile_kv: 32}, [attn_assign=x]]\n"
        'tiny: "no"\n'
    )
    with pytest.raises(InputError) as exc:
        points(spec)
    msg = str(exc.value)
    assert msg.startswith("sweep spec: 4 problems:"), msg
    for want in (
        "tiny: 'no' is not a boolean; write true or false",
        "attn_assign='x': must be one of coarse, interleave, dynamic",
        "chips: ipu-hbm runs kernel by kernel: options {'tile_kv': 32} shape a STeP program",
        "chips: mesh[hbm.channels=8] runs kernel by kernel: options {'tile_kv': 32}",
    ):
        assert want in msg, msg
    with pytest.raises(InputError) as exc:
        points({**base, "chips": ["step-sda", "ipu-hbm"], "tiny": True})
    assert "chips: ipu-hbm runs kernel by kernel, timing the full-size layer: tiny: true" in str(
        exc.value
    )
    assert points({**base, "chips": ["ipu-hbm"], "tiny": False})[0]["tiny"] is False


def test_point_errors_name_the_spec_fields() -> None:
    from torch2step.sweep import run_point

    base = {"layer": "qwen3-moe", "batch": 2, "chip": "step-sda", "set": [], "options": {}}
    row = run_point({**base, "trace": "no_such_trace", "tiny": True})
    assert row["error"].startswith("InputError: traces: unknown routing trace"), row["error"]
    row = run_point({**base, "trace": "auto", "tiny": True, "impl": "bogus"})
    assert row["error"].startswith("InputError: impl 'bogus': choose from"), row["error"]
    assert "--" not in row["error"]


def test_trace_files_resolve_from_the_spec_and_are_hashed_by_content(tmp_path: Path) -> None:
    import numpy as np

    from torch2step.sweep import point_hash

    folder = tmp_path / "specs"
    folder.mkdir()
    trace = folder / "route.npy"
    np.save(trace, np.tile(np.array([[0, 1]]), (64, 1)).astype(np.int64))
    spec = folder / "spec.yaml"
    spec.write_text("layers: [qwen3-moe]\nbatches: [16]\ntraces: [route.npy]\ntiny: true\n")
    (pt,) = points(spec)  # relative to the spec's folder, as chip files are
    assert pt["trace"] == str(trace.resolve())
    out = tmp_path / "out"
    (a,) = run_sweep(spec, out, backend="serial", progress=False)
    assert a["status"] == "ok", a
    # the same path with other contents is another point: rerun, not taken from the cache
    np.save(trace, (np.arange(128).reshape(64, 2) % 8).astype(np.int64))
    assert point_hash(pt) != a["hash"]
    (b,) = run_sweep(spec, out, backend="serial", progress=False)
    assert b["status"] == "ok" and b["hash"] != a["hash"]
    assert b["latency_cycles"] != a["latency_cycles"]


def test_interrupted_sweep_cancels_the_rest_and_keeps_the_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C during the third point: no more points run, the two finished stay cached, the
    # command says so and how to resume, and exits 130
    import argparse

    from torch2step import sweep
    from torch2step.sweep_cli import run_sweep as cli_run_sweep

    ran: list[int] = []

    def fake(point: dict) -> dict:
        if len(ran) == 2:
            raise KeyboardInterrupt
        ran.append(point["batch"])
        return {**dict.fromkeys(ROW_COLUMNS, ""), "hash": sweep.point_hash(point), "status": "ok"}

    monkeypatch.setattr(sweep, "run_point", fake)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "out"
    args = argparse.Namespace(
        spec=spec, out=out, backend="serial", jobs=None, address=None, no_progress=True, quiet=True
    )
    try:
        code = cli_run_sweep(args)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the sweep command as a KeyboardInterrupt")
    assert code == 130
    err = capsys.readouterr().err
    # one line on the interrupt (a log line before it comes from the CLI's logging, which an
    # earlier command of this process may have set up)
    last = err.splitlines()[-1]
    assert last.startswith("torch2step sweep: interrupted: ") and "Traceback" not in err
    assert sum("interrupted: " in ln for ln in err.splitlines()) == 1
    assert f"interrupted: 2 of 5 points finished (kept in {out}/points)" in err, err
    assert f"resume with: torch2step sweep {spec} --out {out} --backend serial" in err, err
    assert ran == [1, 2] and len(list((out / "points").glob("*.json"))) == 2
    assert not (out / "results.csv").exists()
    with pytest.raises(sweep.SweepInterrupted) as exc:  # a KeyboardInterrupt to a caller
        run_sweep(spec, out, backend="serial", progress=False)
    assert isinstance(exc.value, KeyboardInterrupt) and exc.value.finished == 2


@pytest.mark.slow  # starts and interrupts a sweep on a process pool (~10-20 s)
def test_ctrl_c_stops_a_pool_sweep_at_once(tmp_path: Path) -> None:
    spec, out, cmd = _chip_sweep(tmp_path, 6)
    cmd += ["--jobs", "1", "--no-progress"]
    proc = subprocess.Popen(
        cmd, start_new_session=True, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    cache = out / "points"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if cache.is_dir() and len(list(cache.glob("*.json"))) >= 1:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 15  # not after every queued point
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    finished = len(list(cache.glob("*.json")))
    assert 1 <= finished < 6
    assert f"interrupted: {finished} of 6 points finished" in err, err
    rows = run_sweep(spec, out, backend="serial", progress=False)  # resumes
    assert all(r["status"] == "ok" for r in rows) and len(rows) == 6
