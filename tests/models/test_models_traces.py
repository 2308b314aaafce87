"""The packaged real traces: names, formats and the exact statistics of the shared README."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models import TraceFormatError, UnknownTraceError, traces

SHARED = Path("/work/shared/traces")


def test_list_traces() -> None:
    listed = traces.list_traces()
    assert listed["routing"] == ["mixtral_b1024", "mixtral_b64", "qwen_b1024", "qwen_b64"]
    assert len(listed["kv_lengths"]) == 51
    assert sum(n.startswith("b16/") for n in listed["kv_lengths"]) == 21
    assert sum(n.startswith("b64/") for n in listed["kv_lengths"]) == 15
    assert sum(n.startswith("b80/") for n in listed["kv_lengths"]) == 15
    assert len(listed["kv_aliases"]) == 3 * 3 * 4 + 1


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("mixtral_b64", (64, 2)),
        ("mixtral_b1024", (1024, 2)),
        ("qwen_b64", (64, 8)),
        ("qwen_b1024", (1024, 8)),
    ],
)
def test_routing_shapes_and_rows(name: str, shape: tuple[int, int]) -> None:
    data = traces.routing(name)
    assert data.dtype == np.int64 and data.shape == shape
    assert all(len(set(row)) == shape[1] for row in data.tolist())  # distinct experts per token
    experts = 8 if name.startswith("mixtral") else 128
    assert data.min() >= 0 and data.max() < experts


def test_expert_counts_exact() -> None:
    assert traces.expert_counts("mixtral_b64").tolist() == [13, 10, 17, 14, 17, 10, 24, 23]
    assert traces.expert_counts("mixtral_b1024/019_009").tolist() == [
        236,
        219,
        279,
        215,
        164,
        414,
        301,
        220,
    ]
    q64, q1024 = traces.expert_counts("qwen_b64"), traces.expert_counts("qwen_b1024")
    assert q64.shape == (128,) and int((q64 == 0).sum()) == 68 and q64.max() == 42
    assert int((q1024 == 0).sum()) == 45 and q1024[0] == 0
    assert sorted(q1024.tolist())[-4:] == [406, 617, 697, 814]
    assert q1024.sum() == 1024 * 8


def test_kv_lengths_names_and_aliases() -> None:
    lens = traces.kv_lengths("b64/conv_stdev0995_0733_0796")
    assert lens.dtype == np.int64 and lens.shape == (64,)
    assert (lens.min(), lens.max(), round(lens.mean())) == (181, 4096, 938)
    assert np.array_equal(traces.kv_lengths("b64/med1"), lens)
    assert np.array_equal(traces.kv_lengths("b64/conv_stdev0995_0733_0796.npy"), lens)
    aliases = traces.kv_aliases()
    assert aliases["b64/med"] == aliases["b64/med0"] == "b64/conv_stdev0996_4007_4070"
    assert aliases["b64/batch_sweep"] == "b64/conv_stdev0996_4007_4070"
    assert aliases["b80/low2"] == "b80/conv_stdev0529_2025_2104"
    assert (traces.kv_lengths("b16/high").max(), traces.kv_lengths("b16/low2").max()) == (
        4623,
        1320,
    )


def test_figure_group_files_exist_with_their_batch() -> None:
    for folder, tiers in traces.FIGURE_GROUPS.items():
        assert sorted(tiers) == ["high", "low", "med"]
        for stems in tiers.values():
            for stem in stems:
                assert traces.kv_lengths(f"{folder}/{stem}").shape == (int(folder[1:]),)


def test_folder_statistics_match_readme() -> None:
    for folder, (lo, hi) in {"b16": (2, 7930), "b64": (2, 6445), "b80": (11, 6472)}.items():
        arrays = [
            traces.kv_lengths(n) for n in traces.list_traces()["kv_lengths"] if n.startswith(folder)
        ]
        assert min(a.min() for a in arrays) == lo and max(a.max() for a in arrays) == hi


def test_paths_are_accepted(tmp_path: Path) -> None:
    npz = traces.TRACE_DIR / "expert_routing" / "qwen_b64" / "032_012.npz"
    assert np.array_equal(traces.routing(npz), traces.routing("qwen_b64"))
    custom = tmp_path / "lens.npy"
    np.save(custom, np.array([5, 6, 7]))
    assert traces.kv_lengths(str(custom)).tolist() == [5, 6, 7]
    with pytest.raises(UnknownTraceError, match="does not exist"):
        traces.kv_lengths(tmp_path / "missing.npy")


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid names: mixtral_b1024, mixtral_b64"):
        traces.routing("deepseek_b64")
    with pytest.raises(UnknownTraceError, match="b16/high"):
        traces.kv_lengths("b32/high")


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared trace folder not present")
def test_packaged_files_are_byte_identical_to_the_shared_copies() -> None:
    packaged = sorted(p.relative_to(traces.TRACE_DIR) for p in traces.TRACE_DIR.rglob("*.np[yz]"))
    assert len(packaged) == 55
    for rel in packaged:
        assert (traces.TRACE_DIR / rel).read_bytes() == (SHARED / rel).read_bytes(), rel


def test_routing_npy_and_npz_load_alike(tmp_path: Path) -> None:
    ids = np.array([[0, 3], [2, 1], [3, 0]])
    np.save(tmp_path / "r.npy", ids)
    np.savez(tmp_path / "r.npz", data=ids)
    assert traces.routing(tmp_path / "r.npy").tolist() == ids.tolist()
    assert traces.routing(tmp_path / "r.npz").tolist() == ids.tolist()
    np.save(tmp_path / "f.npy", ids.astype(np.float32))  # whole-number floats are ids
    assert traces.routing(tmp_path / "f.npy").dtype == np.int64


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.array([[0.5, 1.0]]), "not whole numbers"),
        (np.array([[0, -1]]), "must be non-negative"),
        (np.array([[2, 2]]), "chooses expert 2 twice"),
        (np.array([0, 1, 2]), "expected 2-D"),
    ],
)
def test_bad_routing_files_say_what_is_wrong(tmp_path: Path, array, match) -> None:
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(TraceFormatError, match=match):
        traces.routing(tmp_path / "bad.npy")


def test_routing_ids_checked_against_the_expert_count(tmp_path: Path) -> None:
    np.save(tmp_path / "r.npy", np.array([[0, 8]]))
    with pytest.raises(TraceFormatError, match=r"expert 8; expert ids must be in \[0, 8\)"):
        traces.routing(tmp_path / "r.npy", num_experts=8)


def test_bad_kv_length_files_say_what_is_wrong(tmp_path: Path) -> None:
    np.save(tmp_path / "neg.npy", np.array([5, -2, 7]))
    with pytest.raises(TraceFormatError, match="request 1 has KV length -2"):
        traces.kv_lengths(tmp_path / "neg.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(TraceFormatError, match="not a NumPy"):
        traces.kv_lengths(tmp_path / "junk.npy")
