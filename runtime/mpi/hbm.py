"""The chip's HBM on MPI ranks (Cyclotron §9: the program's memory operations become the
target's memory operations).

* Read-only tensors (weights, activations no program stores to) are broadcast from the root
  once (``Bcast``); every rank keeps a replica and a ``Load`` is a local numpy slice.
* Tensors some program stores to live in one MPI window on the root rank, opened for passive
  target access (``Lock_all``): a ``Store`` is a ``Put`` (an ``Accumulate`` with ``SUM`` when it
  accumulates) of the region as a subarray datatype, a ``Load`` is a ``Get``, and each is
  completed at the target (``Flush``) before the instruction finishes, so a store is visible to
  every core that a later message or barrier orders after it.

With one rank there is no window: the arrays are the HBM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lowering.isa import TensorDecl
from runtime.layout import numpy_dtype

__all__ = ["Hbm"]

Region = tuple[tuple[int, ...], tuple[int, ...]]


class Hbm:
    """HBM tensors of one run, on ``comm`` (collective: every rank constructs it).

    ``inputs`` are read on the root only; tensors without an input start as zeros."""

    def __init__(
        self,
        MPI: Any,
        comm: Any,
        decls: tuple[TensorDecl, ...],
        inputs: Mapping[str, np.ndarray] | None,
        stored: set[str],
        root: int = 0,
    ) -> None:
        self.MPI = MPI
        self.comm = comm
        self.root = root
        self.is_root = comm.rank == root
        self.decls = {d.name: d for d in decls}
        self.arrays: dict[str, np.ndarray] = {}
        self.wins: dict[str, Any] = {}
        self.types: dict[str, Any] = {}
        self.nbytes_put = self.nbytes_get = 0
        shared = comm.size > 1
        for d in decls:
            dt = numpy_dtype(d.dtype)
            if self.is_root:
                given = (inputs or {}).get(d.name)
                arr = np.zeros(d.shape, dt) if given is None else np.array(given, dtype=dt)
            else:
                arr = np.empty(d.shape, dt) if d.name not in stored else np.empty(0, dt)
            if shared and d.name not in stored:
                comm.Bcast(arr, root=root)
            self.arrays[d.name] = arr
        if shared:
            from mpi4py.util.dtlib import from_numpy_dtype

            for d in decls:
                if d.name in stored:
                    arr = self.arrays[d.name]
                    win = MPI.Win.Create(arr, disp_unit=arr.itemsize, comm=comm)
                    win.Lock_all()
                    self.wins[d.name] = win
                    self.types[d.name] = from_numpy_dtype(arr.dtype)

    # -- instructions -------------------------------------------------------------------------
    def _subarray(self, name: str, region: Region) -> Any:
        starts, extents = region
        t = self.types[name].Create_subarray(self.decls[name].shape, extents, starts)
        t.Commit()
        return t

    def read(self, name: str, region: Region) -> np.ndarray:
        """A copy of ``region`` of tensor ``name``."""
        starts, extents = region
        win = self.wins.get(name)
        if win is None:
            sl = tuple(slice(s, s + e) for s, e in zip(starts, extents))
            return np.array(self.arrays[name][sl])
        out = np.empty(extents, numpy_dtype(self.decls[name].dtype))
        if out.size:
            t = self._subarray(name, region)
            win.Get(out, self.root, target=(0, 1, t))
            win.Flush(self.root)
            t.Free()
            self.nbytes_get += out.nbytes
        return out

    def write(self, name: str, region: Region, data: np.ndarray, accumulate: bool) -> None:
        """Store ``data`` into ``region`` (``accumulate``: add to what is there)."""
        starts, extents = region
        win = self.wins.get(name)
        if win is None:
            arr = self.arrays[name]
            sl = tuple(slice(s, s + e) for s, e in zip(starts, extents))
            if accumulate:
                arr[sl] += data.astype(arr.dtype)
            else:
                arr[sl] = data
            return
        dt = numpy_dtype(self.decls[name].dtype)
        src = np.ascontiguousarray(np.broadcast_to(data, extents), dtype=dt)
        if not src.size:
            return
        t = self._subarray(name, region)
        if accumulate:
            win.Accumulate(src, self.root, target=(0, 1, t), op=self.MPI.SUM)
        else:
            win.Put(src, self.root, target=(0, 1, t))
        win.Flush(self.root)
        t.Free()
        self.nbytes_put += src.nbytes

    def value(self, name: str, index: tuple[int, ...]) -> int:
        """One integer element."""
        return int(self.read(name, (index, (1,) * len(index))).reshape(-1)[0])

    # -- end of the run -----------------------------------------------------------------------
    def close(self) -> dict[str, np.ndarray] | None:
        """Collective: complete the window epochs; the final tensors on the root, else None."""
        for win in self.wins.values():
            win.Unlock_all()
        if self.wins:
            self.comm.Barrier()
        out = {k: np.array(v) for k, v in self.arrays.items()} if self.is_root else None
        for win in self.wins.values():
            win.Free()
        self.wins.clear()
        return out
