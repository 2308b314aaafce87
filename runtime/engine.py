"""The discrete-event simulator: per-core sequencers, transfers through shared resources, FIFOs.

Model (ELK §5: cores with SRAM, a compute pipeline and a network agent; links with latency
and bandwidth, served sequentially; HBM accessed through the interconnect.  STeP §4.2 and
Cyclotron §9.1: per-PE interpreters talking over bounded FIFOs, roofline cycles per kernel):

* Event queue ordered by ``(cycle, priority, sequence number)`` (SimPy's ordering): resource
  events (priority 0) before core wake-ups (priority 1) in the same cycle, then first scheduled
  first; nothing depends on hashing or dict order, so runs are deterministic.  It is a calendar
  queue: a heap of distinct cycles and, per cycle, one FIFO list per priority — the same order as
  a heap of ``(cycle, priority, seq)`` tuples at O(1) per event for the many events that share a
  cycle.
* Cores run their compiled programs (:mod:`runtime.ops`); a core that reaches an instruction
  touching shared state at a cycle later than the queue's clock re-queues itself for that cycle.
* Transfers are resource reservations, not per-byte events (:mod:`runtime.transfer`,
  :mod:`runtime.network`).  An HBM request splits over channels by address
  (:mod:`runtime.layout`); each channel serves its part FIFO at ``bytes_per_cycle_per_channel``
  and the data is there ``latency_cycles`` after the last part.
* FIFOs: credit-based flow control (:mod:`runtime.state`); a message's slot frees when the
  receiver consumes it, at ``max(arrival, cycle the Recv was issued)``.
* Deadlock: when the queue is empty and some program is unfinished, every unfinished core is
  blocked on something only another blocked core could provide; :class:`DeadlockError` lists each
  with its instruction and the channel / barrier / buffer it waits on.

What an *event* is (for the events/s figure), counted once, when the engine processes it: one
operation a sequencer executes (an instruction, or a loop's back-edge), one grant the engine
computes for a resource (a link, a port, or a class of HBM channels served together, see
:meth:`runtime.hbm_classes.HbmClasses._channels`), or one payload delivered (a message into a
destination FIFO, an HBM access's data to its core).  Work done in closed form is counted
separately and never as events: instructions fast-forwarded (``fast_forwarded``) and the
per-channel HBM grants a class grant stands for (``closed_form_grants``).

Progress: ``run(progress=fn)`` (or every run inside ``with progress(fn):``) calls
``fn(cycle, events)`` while the queue advances — checked every ``PROGRESS_EVENTS`` queue pops,
called at most once per ``PROGRESS_SECONDS`` of wall time — and once at the end; ``events`` are
counted as above (what :attr:`runtime.stats.EventCounts.events` of the result will count).  It only reads the clock, so the
cycles and trace are those of a run without it; when off the loop pays one ``None`` test per
distinct cycle.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from heapq import heappop, heappush
from pathlib import Path
from typing import Any

import numpy as np

from hwmodel.chip import AllToAllNoC, Chip
from lowering.isa import ProgramSet
from runtime.checks import describe
from runtime.errors import DeadlockError, SimulationError
from runtime.layout import HbmLayout, numpy_dtype
from runtime.network import Fabric
from runtime.program import Compiled, compile_programs
from runtime.replay import Replay, ReplayUnsupported
from runtime.report import build_result, deadlock_message, event_counts, wait_for
from runtime.state import Core, Pending
from runtime.stats import SimResult
from runtime.transfer import Transfers

__all__ = ["Simulator", "simulate", "progress", "DEFAULT_DMA_QUEUE_DEPTH"]

#: ``fn(cycle, events)``: the simulated cycle reached and the events executed so far.
ProgressFn = Callable[[int, int], None]

#: Progress is checked every this many queue pops and reported at most once per this many seconds.
PROGRESS_EVENTS = 20_000
PROGRESS_SECONDS = 1.0

_PROGRESS: ContextVar[ProgressFn | None] = ContextVar("torch2step_sim_progress", default=None)


@contextmanager
def progress(fn: ProgressFn | None) -> Iterator[None]:
    """Report the progress of every simulation run inside the block to ``fn`` (see the module
    docstring); for callers several layers above :meth:`Simulator.run` (e.g. a report)."""
    token = _PROGRESS.set(fn)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


#: Outstanding HBM requests per core when the chip does not say (``CoreSpec.dma_queue_depth``).
DEFAULT_DMA_QUEUE_DEPTH = 16


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector inside the block (nested blocks are fine; the
    outermost one restores the collector's state).  Building per-core programs, compiling and
    running them allocate millions of acyclic objects (instructions, operations, queue entries)
    that reference counting frees; with the collector on, every full collection re-walks all of
    them, and on a 1472-core chip that costs more than the work itself and grows faster than
    linearly with the program.  Callers that build and simulate in one go (e.g.
    :func:`torch2step.kernel.simulate_schedule`) hold it across both steps.

    When the outermost block ends, what it allocated and is still alive (a plan, a compiled
    program, a result) moves to the collector's oldest generation at once
    (:func:`gc.freeze` then :func:`gc.unfreeze`, which only join the collector's lists).  With
    the collector simply re-enabled, the first young collections would walk every one of those
    objects twice on their way there (seconds for a multi-layer decode step on a 1472-core
    chip); a cycle among them is still collected, by the next full collection.  Objects a
    caller froze itself (:func:`gc.get_freeze_count`) are left as they are."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class Simulator(Transfers):
    """Runs a :class:`ProgramSet` on a :class:`Chip` (``mode``: ``"timing"`` — tiles carry shapes,
    control values are real — or ``"functional"`` — tiles carry numpy data).  Construction
    validates programs and inputs (``checked``: the programs passed
    :func:`lowering.validate_programs`, whose checks include the simulator's declaration checks,
    so they are not repeated); :meth:`run` may be called any number of times."""

    def __init__(
        self,
        programs: ProgramSet,
        chip: Chip,
        *,
        mode: str = "timing",
        inputs: Mapping[str, np.ndarray] | None = None,
        dma_queue_depth: int | None = None,
        checked: bool = False,
    ) -> None:
        self.checked = checked
        if dma_queue_depth is None:
            dma_queue_depth = getattr(chip.core, "dma_queue_depth", DEFAULT_DMA_QUEUE_DEPTH)
        if dma_queue_depth < 1:
            raise SimulationError(f"dma_queue_depth must be at least 1, got {dma_queue_depth}")
        self.dma_depth = dma_queue_depth
        if mode not in ("timing", "functional"):
            raise SimulationError(f"mode must be 'timing' or 'functional', got {mode!r}")
        self.programs = programs
        self.chip = chip
        #: channel name -> cycle of its first message (-1 until sent), for the channels a
        #: caller asks to watch before ``run`` (e.g. the inputs of an EagerMerge)
        #: (``-1`` -> the first message's cycle; a list -> every message's cycle appended)
        self.watch: dict[str, Any] | None = None
        self.mode = mode
        self.functional = mode == "functional"
        self.core_spec = chip.core
        self.sram_bytes = chip.core.sram_bytes  # (ops.h_alloc)
        self.fabric = Fabric(chip)
        self.layout = HbmLayout(chip.hbm, programs.tensors)
        #: channel name -> FIFO depth set by :meth:`deepen` (over the declared one)
        self.depths: dict[str, int] = {}
        self._compiled: Compiled | None = self._compile()
        self._inputs = self._bind(dict(inputs or {}))

    # -- set-up -------------------------------------------------------------------------------

    def _compile(self) -> Compiled:
        with gc_paused():
            return compile_programs(
                self.programs,
                self.chip,
                self.fabric,
                self.layout,
                fast=not self.functional,
                checked=self.checked,
                depths=self.depths,
            )

    def _bind(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        decls = self.layout.tensors
        unknown = sorted(set(inputs) - set(decls))
        if unknown:
            raise SimulationError(
                f"inputs {unknown} are not declared tensors; declared: {sorted(decls)}"
            )
        comp = self._compiled
        assert comp is not None
        loaded, stored, values = comp.load, comp.store, comp.values
        need = values if not self.functional else (loaded | values) - stored
        missing = sorted(need - set(inputs))
        if missing:
            what = (
                "integer tensors read by LoadValue"
                if not self.functional
                else "tensors the programs read"
            )
            raise SimulationError(
                f"{self.mode} mode: missing inputs for {what}: {missing}; pass them in `inputs`"
            )
        bound: dict[str, np.ndarray] = {}
        for name, arr in inputs.items():
            info = decls[name]
            a = np.asarray(arr)
            if tuple(a.shape) != info.shape:
                raise SimulationError(f"input {name!r} has shape {a.shape}, declared {info.shape}")
            if self.functional or info.is_int:
                bound[name] = np.array(a, dtype=numpy_dtype(info.dtype))
        if self.functional:
            for name, info in decls.items():
                if name not in bound:
                    bound[name] = np.zeros(info.shape, dtype=numpy_dtype(info.dtype))
        return bound

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        *,
        trace: bool | str | Path = False,
        max_cycles: int | None = None,
        progress: ProgressFn | None = None,
        copy_starts: bool = False,
    ) -> SimResult:
        """Simulate to completion; ``trace`` records a Chrome trace (a path also writes it);
        ``progress``: ``fn(cycle, events)`` called while running (module docstring; default:
        the one set by :func:`progress`); ``copy_starts``: record when each core starts each
        copy of an equal layer's section (:attr:`runtime.stats.SimResult.copy_starts`), and the
        shared resources' state when each layer's first copy starts (``copy_marks``)."""
        wall = time.perf_counter()
        # the collector stays off for the whole run: the set-up allocates many small objects
        # (per-resource state), which would otherwise start a collection of the compiled
        # program here
        with gc_paused():
            self.progress = progress if progress is not None else _PROGRESS.get()
            comp = self._compiled or self._compile()
            self._compiled = None
            self.comp = comp
            # per resource: [free from, busy cycles, bytes, grants, rate] (Transfers)
            self.rs = [[0.0, 0.0, 0, 0, r.rate] for r in self.fabric.res]
            self.chan_res = self.fabric.chan_res
            self.attached = self.fabric.attached
            # HBM channel classes (runtime.hbm_classes): at first one class of every channel
            nch = len(self.chan_res)
            self.hbm_plans: dict[int, tuple] = {}
            self.hbm_vals: dict[tuple, tuple] = {}  # the same plans by split value
            self.hver = 0
            self.cls_of = [0] * nch
            self.cmembers = [list(range(nch))] if nch and not self.attached else []
            self.cfree, self.cbusy = [0.0] * len(self.cmembers), [0.0] * len(self.cmembers)
            self.cbytes, self.ccnt = [0] * len(self.cmembers), [0] * len(self.cmembers)
            self.cparts, self.clogs = {}, {}  # merged classes' parts and busy logs
            self.hrate = self.rs[self.chan_res[0]][4] if nch else 1.0
            self.hbm_data = {k: v.copy() for k, v in self._inputs.items()}
            self.dirty: set[str] = set()
            self.tracing = bool(trace)
            self.copy_starts: list[tuple] | None = [] if copy_starts else None
            self.copy_marks: dict[int, tuple] = {}  # (runtime.program_layers.h_call)
            self.ctrace: list[tuple] = []
            self.rtrace: list[tuple] | None = [] if self.tracing else None
            self.bg_reset()  # background traffic (runtime.transfer)
            noc = self.chip.noc
            self.inline_ok = (  # (Transfers.inline_hbm)
                not self.tracing
                and isinstance(noc, AllToAllNoC)
                and self.chip.hbm.latency_cycles + noc.latency_cycles > 0
            )
            self.inline_hbm = False
            self.times: list[int] = []
            self.buckets: dict[int, tuple[list, list]] = {}
            self.now = 0
            self.n_pops = self.n_deliv = self.msg_bytes = self.unreceived = 0
            self.hbm_rd = self.hbm_wr = 0
            self.n_cls = 0  # HBM channel-class grants computed (HbmClasses._channels)
            self.ndone = 0
            for core in comp.active:
                self.schedule(core, 0)
            try:
                self._loop(max_cycles)
            finally:
                self.hbm_flush()
            result = build_result(self, time.perf_counter() - wall)
            self._release()
        if isinstance(trace, (str, Path)):
            result.write_trace(trace)
        return result

    def _release(self) -> None:
        """After a completed run: break the reference cycles of the run's working state (cores
        <-> operations <-> buffers <-> receives) so that reference counting frees the compiled
        program at once, rather than a cyclic collection walking its millions of objects later.
        A completed run received every message, and a consumed message is unlinked from its
        FIFO and its receive (:meth:`Transfers.consume`); a channel and its FIFOs refer to
        each other, so the FIFOs' link back is cut here.  What stays readable:
        ``comp.active`` and each core's statistics, ``comp.chans`` (names, depths, sources,
        destinations) and ``comp.groups``."""
        for core in self.comp.cores:
            core.code = []
            core.bufs = {}
        for ch in self.comp.chans.values():
            for end in ch.ends:
                end.chan = None
        self.comp.templates = []  # (runtime.program_layers) their operations hold buffers
        self.comp.frames = {}
        self.comp.fifo_ends = None

    def resume(self) -> None:
        """Continue a run that stopped with a :class:`DeadlockError` (after :meth:`deepen`)
        until it completes or deadlocks again; its timing is that of the changed network from
        the stuck state on, so callers use it to explore, not for results."""
        with gc_paused():
            self._loop(None)

    def channel_depth(self, name: str) -> int:
        """The FIFO depth (messages per destination) channel ``name`` has now."""
        return self._chans()[name].depth

    def deepen(self, name: str, depth: int) -> None:
        """Make channel ``name``'s FIFOs ``depth`` deep: before :meth:`run`, for the run (and
        every later one); during a stuck run, from now on — a sender stopped on one of them
        retries its send now (to :meth:`resume` a run that deadlocked on a full FIFO)."""
        state = self._chans()[name]
        self.depths[name] = depth
        state.set_depth(depth)
        if self._compiled is None:  # a run is under way: wake its stopped senders
            for end in state.ends:
                w = end.waiter
                if w is not None:
                    end.waiter = None
                    self.wake(w, self.now)

    def _chans(self) -> dict:
        comp = self._compiled if self._compiled is not None else self.comp
        return comp.chans

    def replay(self) -> Replay:
        """An untimed replay of the programs (:mod:`runtime.replay`: where they deadlock,
        without the timing model) with the current depths; timing mode only.  Before
        :meth:`run` it borrows the compiled programs and puts them back as compiled when done
        (:meth:`Replay.close`); otherwise it compiles them afresh."""
        if self.functional:
            raise ReplayUnsupported("the untimed replay models timing mode only")
        comp = self._compiled
        self._compiled = None
        if comp is None:
            comp = self._compile()
        try:
            return Replay(comp, self._inputs, self.programs.name, self._give_back)
        except ReplayUnsupported:
            self._give_back(comp)  # untouched: the checks come first
            raise

    def _give_back(self, comp: Compiled) -> None:
        if self._compiled is None and not hasattr(self, "comp"):
            self._compiled = comp

    def waits(self) -> dict[int, tuple[int | None, str | None]]:
        """After a :class:`DeadlockError`: each unfinished core's ``(core it waits on, full
        channel or None)`` (:func:`runtime.report.wait_for`)."""
        return wait_for(self)

    def _loop(self, max_cycles: int | None) -> None:
        """Advance the calendar queue until it is empty.  A cycle's bucket holds two FIFO
        lists: transfer stages whose head arrives then (priority 0: each entry is the argument
        tuple of :meth:`_stage`) and cores to resume (priority 1); a stage queued while the
        cycle is being processed runs before the next core."""
        times, buckets = self.times, self.buckets
        limit = math.inf if max_cycles is None else max_cycles
        stage = self._stage
        inl = self.inline_ok
        pops = 0
        report = getattr(self, "progress", None)
        check_at = PROGRESS_EVENTS
        last = time.perf_counter()
        try:
            while times:
                t = heappop(times)
                if t > limit:
                    raise SimulationError(
                        f"simulation passed max_cycles={max_cycles} with "
                        f"{len(self.comp.active) - self.ndone} programs unfinished; raise the limit"
                    )
                self.now = t
                hops, cores = buckets[t]
                # a list's iterator also yields the items appended while it runs (a stage
                # queued for this cycle by a stage); one that is exhausted yields nothing more,
                # so the stages a core queues are walked by a new iterator from where the last
                # one stopped
                if hops:
                    self.inline_hbm = False
                    for h in hops:
                        stage(*h)
                    self.inline_hbm = inl
                done = len(hops)
                for core in cores:  # run the core until it yields, blocks or finishes
                    code = core.code
                    n = 0
                    try:
                        while True:
                            op = code[core.pc]
                            if not op.fn(self, core, op):
                                break
                            n += 1
                    except KeyError as exc:  # a register read before it is set
                        if not exc.args or not isinstance(exc.args[0], str):
                            raise
                        raise self.error(
                            core, f"register {exc.args[0]!r} is read before it is set"
                        ) from None
                    core.stepped += n
                    if len(hops) > done:  # stages the core queued for this cycle
                        self.inline_hbm = False
                        it = iter(hops)
                        it.__setstate__(done)
                        for h in it:
                            stage(*h)
                        done = len(hops)
                        self.inline_hbm = inl
                pops += done + len(cores)
                del buckets[t]
                if report is not None and pops >= check_at:
                    check_at = pops + PROGRESS_EVENTS
                    now = time.perf_counter()
                    if now - last >= PROGRESS_SECONDS:
                        last = now
                        self.n_pops = pops
                        report(t, event_counts(self).events)
        finally:
            self.n_pops = pops
            self.inline_hbm = False
        if report is not None:
            report(self.now, event_counts(self).events)
        if self.ndone < len(self.comp.active):
            raise DeadlockError(deadlock_message(self))
        for ch in self.comp.chans.values() if self.unreceived else ():
            for end in ch.ends:
                if end.unmatched:
                    raise SimulationError(
                        f"channel {ch.name!r}: {len(end.unmatched)} message(s) from core {ch.src} "
                        f"were never received by core {end.dst}; add the matching Recv or drop the Send"
                    )
        if max_cycles is not None:
            late = [c.id for c in self.comp.active if c.finish > max_cycles]
            if late:
                raise SimulationError(
                    f"cores {late} finish after max_cycles={max_cycles}; raise the limit"
                )

    def schedule(self, core: Core, t: int) -> None:
        """Resume ``core`` at cycle ``t``."""
        b = self.buckets.get(t)
        if b is None:
            b = self.buckets[t] = ([], [])
            heappush(self.times, t)
        b[1].append(core)

    def block(self, core: Core, why: tuple, pending: Pending | None) -> None:
        """``core`` waits for ``pending`` (or for a barrier / FIFO credit: ``why``)."""
        core.blocked = why
        if pending is not None:
            if pending.waiters is None:
                pending.waiters = [core]
            else:
                pending.waiters.append(core)

    def wake(self, core: Core, t: int) -> None:
        """Re-run a blocked core's instruction at cycle ``t`` (or its own clock, if later)."""
        if core.blocked is None:
            return
        core.blocked = None
        if core.t > t:
            t = core.t
        if self.now > t:
            t = self.now
        b = self.buckets.get(t)
        if b is None:
            b = self.buckets[t] = ([], [])
            heappush(self.times, t)
        b[1].append(core)

    def resolve(self, p: Pending, t: int) -> None:
        """``p`` completes at cycle ``t``: wake its waiters."""
        p.time = t
        ws = p.waiters
        if ws:
            p.waiters = None
            for c in ws:
                self.wake(c, t)

    def finished(self, core: Core) -> None:
        """``core`` ran its program to the end."""
        core.done = True
        core.finish = core.t
        self.ndone += 1

    def error(self, core: Core, msg: str) -> SimulationError:
        """A :class:`SimulationError` naming the core and its current instruction."""
        ins = core.code[core.pc].src if core.pc < len(core.code) else None
        return SimulationError(f"core {core.id} at cycle {core.t}, `{describe(ins)}`: {msg}")


def simulate(
    programs: ProgramSet,
    chip: Chip,
    *,
    mode: str = "timing",
    inputs: Mapping[str, np.ndarray] | None = None,
    trace: bool | str | Path = False,
    max_cycles: int | None = None,
    dma_queue_depth: int | None = None,
    progress: ProgressFn | None = None,
    copy_starts: bool = False,
) -> SimResult:
    """Run ``programs`` on ``chip`` and return cycles, statistics, HBM contents and trace
    (``progress``, ``copy_starts``: see :meth:`Simulator.run`)."""
    with gc_paused():  # one pause across compiling and running
        sim = Simulator(programs, chip, mode=mode, inputs=inputs, dma_queue_depth=dma_queue_depth)
        return sim.run(
            trace=trace, max_cycles=max_cycles, progress=progress, copy_starts=copy_starts
        )
