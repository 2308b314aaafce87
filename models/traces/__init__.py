"""Real traces that drive the dynamic parts of the layers: expert choices and KV-cache lengths.

The files are the STeP artifact's traces (STeP §5), byte-identical to their sources:
github.com/stanford-ppl/step_artifact (commit 42f9250) ``dyn_tiling/expert_routing/`` and
``dynamic_par/azure_trace/``; no licence stated there (cite Sohn et al., "Streaming Tensor Program",
arXiv 2511.07776). The KV lengths are rows of the Azure LLM inference trace 2023 (CC-BY 4.0,
github.com/Azure/AzurePublicDataset; attribution: Patel et al., "Splitwise", ISCA 2024). Full
provenance: README.md in this folder's source tree.

- ``expert_routing/<model>_b<batch>/<iter>_<layer>.npz``: array ``data``, int64 ``(tokens, top_k)``,
  ``data[t, j]`` = j-th expert chosen for token t (Mixtral-8x7B: 8 experts, top-2;
  Qwen3-30B-A3B: 128 experts, top-8). Names: ``"mixtral_b64"``, ``"mixtral_b1024"``,
  ``"qwen_b64"``, ``"qwen_b1024"`` (the folder; each holds one file) or ``"mixtral_b64/008_010"``.
- ``kv_lengths/b<batch>/conv_stdev<S>_<A>_<B>.npy``: int64 ``(batch,)`` prompt lengths (tokens)
  of one decode batch from the Azure LLM inference trace. Names: ``"b64/conv_stdev0995_0733_0796"``
  or an alias ``"b64/high"``, ``"b64/med1"``, ``"b64/low2"`` (the paper's figure groups, three
  files per tier, index 0-2 in decreasing spread; no index = 0) and ``"b64/batch_sweep"``.

Every loader also accepts a path to an ``.npz`` / ``.npy`` file in the same format.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from models.errors import TraceFormatError, UnknownTraceError

__all__ = [
    "TRACE_DIR",
    "ROUTING_EXPERTS",
    "FIGURE_GROUPS",
    "routing",
    "expert_counts",
    "kv_lengths",
    "kv_aliases",
    "list_traces",
]

TRACE_DIR = Path(__file__).resolve().parent
_ROUTING_DIR = TRACE_DIR / "expert_routing"
_KV_DIR = TRACE_DIR / "kv_lengths"

# Experts per model prefix of the routing folders (Mixtral-8x7B, Qwen3-30B-A3B).
ROUTING_EXPERTS: dict[str, int] = {"mixtral": 8, "qwen": 128}

# The files each paper figure uses (STeP Fig. 11; later version Fig. 14/21), per batch folder and
# spread tier, in decreasing standard deviation — as marked in the shared traces README.
FIGURE_GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "b16": {
        "high": (
            "conv_stdev1456_2805_2820",
            "conv_stdev1455_0821_0836",
            "conv_stdev1454_0985_1000",
        ),
        "med": ("conv_stdev0987_3275_3290", "conv_stdev0987_3349_3364", "conv_stdev0986_3181_3196"),
        "low": ("conv_stdev0480_3799_3814", "conv_stdev0479_2477_2492", "conv_stdev0479_1063_1078"),
    },
    "b64": {
        "high": (
            "conv_stdev1457_0961_1024",
            "conv_stdev1374_3239_3302",
            "conv_stdev1370_1727_1790",
        ),
        "med": ("conv_stdev0996_4007_4070", "conv_stdev0995_0733_0796", "conv_stdev0995_3123_3186"),
        "low": ("conv_stdev0508_2019_2082", "conv_stdev0484_4185_4248", "conv_stdev0477_0271_0334"),
    },
    "b80": {
        "high": (
            "conv_stdev1413_0981_1060",
            "conv_stdev1334_3227_3306",
            "conv_stdev1310_0815_0894",
        ),
        "med": ("conv_stdev0987_1891_1970", "conv_stdev0987_4687_4766", "conv_stdev0986_3989_4068"),
        "low": ("conv_stdev0562_4181_4260", "conv_stdev0531_0135_0214", "conv_stdev0529_2025_2104"),
    },
}
_BATCH_SWEEP = "b64/conv_stdev0996_4007_4070"  # later version Fig. 15: first B of these 64 lengths


def _is_path(name: str | os.PathLike[str]) -> bool:
    """Path objects, existing files, and absolute or ``./``-relative strings are paths; other
    strings are trace names (``"b64/conv_stdev0995_0733_0796.npy"`` is a name)."""
    if not isinstance(name, str):
        return True
    return Path(name).is_file() or os.path.isabs(name) or name.startswith(("./", "../"))


def _routing_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for f in sorted(_ROUTING_DIR.glob("*/*.npz")):
        out[f"{f.parent.name}/{f.stem}"] = f
    return out


def _routing_path(name: str | os.PathLike[str]) -> Path:
    if _is_path(name):
        p = Path(name)
        if not p.is_file():
            raise UnknownTraceError(f"routing trace file {os.fspath(name)!r} does not exist")
        return p
    files = _routing_files()
    key = os.fspath(name).removesuffix(".npz")
    if key in files:
        return files[key]
    in_folder = [p for k, p in files.items() if k.split("/")[0] == key]
    if len(in_folder) == 1:
        return in_folder[0]
    folders = sorted({k.split("/")[0] for k in files})
    raise UnknownTraceError(
        f"unknown routing trace {key!r}; valid names: {', '.join(folders + list(files))}, "
        "or a path to an .npz (array 'data') or .npy file of integer shape (tokens, top_k)"
    )


def _load_array(path: Path, kind: str) -> np.ndarray:
    """The array of an ``.npy`` file, or of an ``.npz`` file's ``data`` (or only) array."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise TraceFormatError(f"{kind} trace {os.fspath(path)!r} is not a NumPy .npy/.npz file: {e}") from e
    if isinstance(loaded, np.ndarray):
        return loaded
    with loaded as npz:
        names = list(npz.files)
        if "data" in names:
            return np.asarray(npz["data"])
        if len(names) == 1:
            return np.asarray(npz[names[0]])
    raise TraceFormatError(
        f"{kind} trace {os.fspath(path)!r} holds arrays {names}; expected one array named 'data'"
    )


def _as_int64(data: np.ndarray, path: Path, kind: str) -> np.ndarray:
    """``data`` as int64; floats are accepted only when every value is a whole number."""
    if data.dtype.kind in "iu":
        return data.astype(np.int64, copy=False)
    if data.dtype.kind == "f" and np.all(np.isfinite(data)) and np.all(data == np.round(data)):
        return data.astype(np.int64)
    raise TraceFormatError(
        f"{kind} trace {os.fspath(path)!r} holds {data.dtype} values that are not whole numbers "
        f"(e.g. {data.ravel()[:3].tolist()}); "
        f"{'expert ids' if kind == 'routing' else 'lengths'} must be integers"
    )


def routing(name: str | os.PathLike[str], num_experts: int | None = None) -> np.ndarray:
    """Per-token expert choices: int64 array ``(tokens, top_k)`` (see the module docstring).

    Files may be ``.npz`` (array ``data``) or ``.npy``. With ``num_experts``, every id must lie in
    ``[0, num_experts)``; ids are checked to be whole numbers and non-negative, and a token may
    not choose the same expert twice.
    """
    path = _routing_path(name)
    data = _as_int64(_load_array(path, "routing"), path, "routing")
    if data.ndim != 2:
        raise TraceFormatError(
            f"routing trace {os.fspath(path)!r}: expected 2-D data (tokens, top_k), got shape "
            f"{data.shape}"
        )
    high = num_experts if num_experts is not None else None
    bad = (data < 0) if high is None else (data < 0) | (data >= high)
    if bad.any():
        t, j = (int(v) for v in np.argwhere(bad)[0])
        allowed = "non-negative" if high is None else f"in [0, {high})"
        raise TraceFormatError(
            f"routing trace {os.fspath(path)!r}: token {t} choice {j} is expert {data[t, j]}; "
            f"expert ids must be {allowed}"
        )
    if data.shape[1] > 1:
        srt = np.sort(data, axis=1)
        dup = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
        if dup.size:
            raise TraceFormatError(
                f"routing trace {os.fspath(path)!r}: token {int(dup[0])} chooses expert "
                f"{int(srt[dup[0]][np.nonzero(srt[dup[0], 1:] == srt[dup[0], :-1])[0][0]])} twice; "
                "each token's top-k experts must be distinct"
            )
    return data


def expert_counts(name: str | os.PathLike[str], num_experts: int | None = None) -> np.ndarray:
    """Tokens routed to each expert, int64 ``(num_experts,)``.

    ``num_experts`` defaults to the model of the folder prefix (``mixtral`` 8, ``qwen`` 128), else
    to ``max index + 1``.
    """
    data = routing(name)
    if num_experts is None:
        prefix = _routing_path(name).parent.name.split("_")[0]
        num_experts = ROUTING_EXPERTS.get(prefix, int(data.max()) + 1)
    return np.bincount(data.ravel(), minlength=num_experts).astype(np.int64)


def kv_aliases() -> dict[str, str]:
    """Short names -> canonical KV-length trace names (``"b64/high"`` -> ``"b64/conv_stdev..."``)."""
    out: dict[str, str] = {}
    for folder, tiers in FIGURE_GROUPS.items():
        for tier, stems in tiers.items():
            out[f"{folder}/{tier}"] = f"{folder}/{stems[0]}"
            for i, stem in enumerate(stems):
                out[f"{folder}/{tier}{i}"] = f"{folder}/{stem}"
    out["b64/batch_sweep"] = _BATCH_SWEEP
    return out


def _kv_files() -> dict[str, Path]:
    return {f"{f.parent.name}/{f.stem}": f for f in sorted(_KV_DIR.glob("*/*.npy"))}


def kv_lengths(name: str | os.PathLike[str]) -> np.ndarray:
    """Per-request KV-cache lengths (tokens) of one decode batch: int64 ``(batch,)``."""
    if _is_path(name):
        path = Path(name)
        if not path.is_file():
            raise UnknownTraceError(f"KV-length trace file {os.fspath(name)!r} does not exist")
    else:
        key = os.fspath(name).removesuffix(".npy")
        key = kv_aliases().get(key, key)
        files = _kv_files()
        if key not in files:
            raise UnknownTraceError(
                f"unknown KV-length trace {os.fspath(name)!r}; valid names: "
                f"{', '.join(list(kv_aliases()) + list(files))}, or a path to an int64 .npy file"
            )
        path = files[key]
    data = _as_int64(_load_array(path, "KV-length"), path, "KV-length")
    if data.ndim != 1:
        raise TraceFormatError(
            f"KV-length trace {os.fspath(path)!r}: expected 1-D data (batch,), got shape {data.shape}"
        )
    if (data < 0).any():
        b = int(np.argmax(data < 0))
        raise TraceFormatError(
            f"KV-length trace {os.fspath(path)!r}: request {b} has KV length {int(data[b])}; "
            "lengths must be >= 0"
        )
    return data


def list_traces() -> dict[str, list[str]]:
    """Names the loaders accept: ``{"routing": [...], "kv_lengths": [...], "kv_aliases": [...]}``.

    ``"routing"`` lists folder names (``"mixtral_b64"``); ``"kv_lengths"`` the canonical
    ``"b<batch>/conv_stdev..."`` names.
    """
    return {
        "routing": sorted({k.split("/")[0] for k in _routing_files()}),
        "kv_lengths": list(_kv_files()),
        "kv_aliases": list(kv_aliases()),
    }
