"""The buffers of one unit's program: rotating pools, one-row buffers of a count's rows, and
what the program leaves to the run's row counts.

:class:`UnitBuffers` is the buffer half of :class:`~.unit.UnitBuilder`: buffers are named per
role and rotate among ``rotation`` copies (so a unit can receive or compute the next element
while the previous one is still being sent); each is allocated once, at the start, with the
largest size it holds in the run — or, for a tile whose rows are a count with a bound
(``bound``: an expert's tokens), at the bound, ``Alloc.held`` (the simulator counts what it
holds; dynamic tiling, STeP arXiv 2511.07776 §5.2).  A unit whose every step on such tiles
follows their run-time rows (row rules, :mod:`.rows`) and whose buffers hold them at their bound
is the same program for every count: :meth:`UnitBuffers.sizing` gives its bookkeeping as
functions of the counts (:mod:`.sizing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lowering.isa import DTYPE_BYTES, Alloc
from torch2step.step.types import TileType

from .sizing import Sizing
from .timing import RowRule

__all__ = ["Bound", "MessageRows", "UnitBuffers"]


@dataclass(frozen=True)
class MessageRows:
    """The rows of the tile in message ``seq`` of ``channel``: a row count that is ragged,
    one per element (a KV tile's ``(row, r)`` rows, STeP arXiv 2511.07776 §3.1), stands for
    itself in a unit's :class:`~.sizing.Sizing` and is read from each run's messages; ``seq``
    ``-1``: the most rows any message of ``channel`` holds (a buffer that a loop receives or
    loads every tile of the channel into, :mod:`.kv_loop`)."""

    channel: str
    seq: int


class _Pool:
    __slots__ = ("names", "dtype", "cap", "bound", "fixed", "sized", "used")

    def __init__(self, prefix: str, dtype: str, rotation: int) -> None:
        self.names = [f"{prefix}{i}" if rotation > 1 else prefix for i in range(rotation)]
        self.dtype = dtype
        self.cap = 0  # the most elements a buffer of the pool holds in this run
        self.bound: int | None = None  # capacity bound of tiles of run-dependent size
        self.fixed = 0  # the most elements of its tiles of static size
        self.sized: set[tuple[object, int, int]] = set()  # (rows, a, c): a*rows + c elements
        self.used = 0


#: ``bound(rows)``: the capacity bound of a declared row count whose value only the run knows
#: (an expert's token count is at most the tokens routed), ``None`` when it has none.
Bound = Callable[[object], "int | None"]


class UnitBuffers:
    """The buffers of one unit (see the module docstring) and the bookkeeping of its steps on
    run-sized tiles (``rule_steps``, ``flops``, ``busy_cycles``)."""

    def __init__(self, bound: Bound | None = None) -> None:
        self.bound = bound
        # buffer -> (rows, their bound) of the run-sized tile it holds
        self.rows_of: dict[str, tuple[object, int]] = {}
        # False once the program depends on a run's row counts (:meth:`sizing`)
        self.rows_free = True
        # (rule, rows, cycles, FLOPs, whether the rule's first term counts the FLOPs)
        self.rule_steps: list[tuple[RowRule, object, int, int, bool]] = []
        # one-row buffers of a count's rows: (names, dtype, cols, rows, rows this run)
        self.row_pools: list[tuple[list[str], str, int, object, int]] = []
        self.pools: dict[tuple, _Pool] = {}
        self.flops = 0
        self.busy_cycles = 0

    def buffer(
        self,
        role: tuple,
        dtype: str,
        elems: int,
        rotation: int = 1,
        sized: tuple[object, int, int, int] | None = None,
    ) -> str:
        """The next buffer of ``role`` (rotating among ``rotation`` copies), able to hold
        ``elems`` elements of ``dtype``; ``sized``: ``(rows, bound, a, c)`` for a tile of
        ``a*rows + c`` elements whose rows only the run knows, at most ``bound``: the buffer
        is allocated at ``a*bound + c``."""
        key = (role, dtype)
        pool = self.pools.get(key)
        if pool is None:
            tag = ".".join(str(r) for r in role)
            pool = self.pools[key] = _Pool(f"{tag}.{dtype}.", dtype, rotation)
        pool.cap = max(pool.cap, elems)
        if sized is None:
            pool.fixed = max(pool.fixed, elems)
        else:
            rows, bound, a, c = sized
            pool.bound = max(pool.bound or 0, a * bound + c)
            pool.sized.add((rows, a, c))
        name = pool.names[pool.used % len(pool.names)]
        pool.used += 1
        return name

    def row_buffers(
        self, role: tuple, dtype: str, cols: int, rows: object, bound: int, held: int
    ) -> list[str]:
        """``bound`` buffers of one ``cols``-element row each, for the rows of a count
        ``rows`` (at most ``bound``; ``held`` of them in this run), allocated held
        (``Alloc.held``: the simulator counts the rows they hold)."""
        tag = ".".join(str(r) for r in role)
        names = [f"{tag}.{j}.{dtype}" for j in range(bound)]
        self.row_pools.append((names, dtype, cols, rows, held))
        return names

    def _rows(self, decl: TileType | None) -> tuple[object, int] | None:
        """``(rows, bound)`` of a declared tile whose rows only the run knows and have a bound
        (``None`` for a static tile); a tile of unbounded rows makes the program the run's."""
        if decl is None or decl.shape[0].is_Integer and decl.shape[1].is_Integer:
            return None
        b = None
        if self.bound is not None and decl.shape[1].is_Integer:
            b = self.bound(decl.shape[0])
        if b is None:
            self.rows_free = False
            return None
        return decl.shape[0], b

    def _holds(self, buf: str, rows: tuple[object, int] | None) -> None:
        """``buf`` now holds a tile of ``rows`` (``None``: of static size)."""
        if rows is not None:
            self.rows_of[buf] = rows
        elif self.rows_of:
            self.rows_of.pop(buf, None)

    def _resize(self, buf: str, sized: tuple[object, int, int, int]) -> None:
        for pool in self.pools.values():
            if buf in pool.names:
                rows, bound, a, c = sized
                pool.bound = max(pool.bound or 0, a * bound + c)
                pool.sized.add((rows, a, c))
                return

    # -- result ----------------------------------------------------------------------------------

    def allocs(self) -> tuple[Alloc, ...]:
        """One ``Alloc`` per buffer used, at its largest size."""
        out = []
        for pool in self.pools.values():
            for name in pool.names[: min(pool.used, len(pool.names))]:
                if pool.bound is None:
                    out.append(Alloc(name, (pool.cap,), pool.dtype))
                else:  # at its bound; the simulator counts what it holds (Alloc.held)
                    out.append(Alloc(name, (max(pool.cap, pool.bound),), pool.dtype, True))
        for names, dtype, cols, _, _ in self.row_pools:
            out.extend(Alloc(name, (cols,), dtype, True) for name in names)
        return tuple(out)

    def sizing(self) -> Sizing | None:
        """What the program leaves to the run's row counts (:class:`Sizing`), when it reads
        every run-sized tile's rows at run time and holds it in a buffer allocated at its
        bound; ``None`` when the program depends on the rows of this run or has no run-sized
        tile."""
        if not self.rows_free or not (
            self.row_pools or any(pool.sized for pool in self.pools.values())
        ):
            return None
        pools = tuple(
            (
                DTYPE_BYTES[pool.dtype] * min(pool.used, len(pool.names)),
                pool.fixed,
                tuple(sorted(pool.sized, key=str)),
            )
            for pool in self.pools.values()
        ) + tuple(
            (DTYPE_BYTES[dtype], 0, ((rows, cols, 0),))
            for _, dtype, cols, rows, _ in self.row_pools
        )
        ruled = sum(c for _, _, c, _, _ in self.rule_steps)
        work = sum(f for _, _, _, f, _ in self.rule_steps)
        steps = tuple((rule, rows, counted) for rule, rows, _, _, counted in self.rule_steps)
        return Sizing(pools, self.busy_cycles - ruled, steps, self.flops - work)

    @property
    def sram_bytes(self) -> int:
        """On-chip bytes of all the unit's buffers (of one-row buffers: the rows held)."""
        return sum(
            pool.cap * DTYPE_BYTES[pool.dtype] * min(pool.used, len(pool.names))
            for pool in self.pools.values()
        ) + sum(DTYPE_BYTES[dt] * cols * held for _, dt, cols, _, held in self.row_pools)
