"""One MPI rank running its share of the cores, and how the ranks agree that the run ended.

The rank interprets its cores round-robin (:mod:`.interp`): each runs until it blocks; between
rounds the rank moves messages (:mod:`.net`) and barriers along.  A rank whose cores all wait
backs off (sleeps up to ``_MAX_SLEEP``), so oversubscribed ranks share the machine's cores.

Termination and deadlock (the rank of the root coordinates on its own communicator): when the
root has nothing to run it asks every rank for its state — finished, or blocked with no progress
for ``timeout`` seconds and what each of its cores waits on.  All finished: the run is done.
All finished or blocked, some blocked: it is a deadlock, and the root sends every rank the
report of who waits on whom — ranks, cores, instructions, channels, barriers — in the words of
the simulator's report (:func:`runtime.report.deadlock_message`), never a hang.  A rank that
fails sends its error to the root, which stops every rank with it.
"""

from __future__ import annotations

import time
from typing import Any

from hwmodel.chip import Chip
from lowering.isa import ProgramSet
from runtime.checks import describe
from runtime.errors import DeadlockError, SimulationError
from runtime.mpi.errors import MpiError
from runtime.mpi.hbm import Hbm
from runtime.mpi.interp import CoreRun
from runtime.mpi.net import Net
from runtime.mpi.placement import RankPlan
from runtime.report import core_name

__all__ = ["RankRun", "Group"]

#: Longest back-off (seconds) of a rank whose cores all wait: short enough for message
#: latency, long enough to hand the CPU to other ranks on an oversubscribed machine.
_MAX_SLEEP = 0.0003
_QUERY, _ANSWER, _DONE, _ABORT, _ERROR = range(1, 6)
_ERRORS = {"deadlock": DeadlockError, "simulation": SimulationError, "mpi": MpiError}


class Group:
    """A barrier group on this rank: arrivals of its local members, the generation, and the
    ``Ibarrier`` with the group's other ranks (``comm``: None when all members are local)."""

    __slots__ = ("name", "members", "local", "arrived", "gen", "comm", "req")

    def __init__(self, name: str, members: tuple[int, ...], local: set[int], comm: Any) -> None:
        self.name = name
        self.members = members
        self.local = local
        self.arrived: set[int] = set()
        self.gen = 0
        self.comm = comm
        self.req: Any = None

    def arrive(self, core: int) -> int:
        """Core ``core`` arrives; returns the generation it waits to see pass."""
        gen = self.gen
        self.arrived.add(core)
        if len(self.arrived) == len(self.local):
            if self.comm is None:
                self._release()
            else:
                self.req = self.comm.Ibarrier()
        return gen

    def _release(self) -> None:
        self.arrived = set()
        self.gen += 1

    def poll(self) -> bool:
        if self.req is not None and self.req.Test():
            self.req = None
            self._release()
            return True
        return False


class RankRun:
    """The cores of one rank and the loop that runs them (collective constructor)."""

    def __init__(
        self,
        MPI: Any,
        comm: Any,
        ps: ProgramSet,
        plan: RankPlan,
        chip: Chip | None,
        inputs: dict[str, Any] | None,
        stored: set[str],
        timeout: float,
        fifo_depth: int,
    ) -> None:
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.ps = ps
        self.plan = plan
        self.chip = chip
        self.timeout = timeout
        self.sram_bytes = chip.core.sram_bytes if chip is not None else None
        self.decls = {d.name: d for d in ps.tensors}
        self.ctrl = comm.Dup()
        self.hbm = Hbm(MPI, comm, ps.tensors, inputs, stored)
        self.net = Net(MPI, comm, ps, plan, fifo_depth)
        self.groups = self._groups(ps)
        mine = set(plan.cores[self.rank])
        self.cores = [CoreRun(self, p.core, p.body) for p in ps.programs if p.core in mine]
        self.progress = 0
        self.compute_s = 0.0
        self.hbm_read = self.hbm_write = 0  # bytes in the chip's dtypes, as the simulator counts
        self.idle_s = 0.0
        self.rounds = 0
        self.finish_s: float | None = None  # seconds until this rank's last core finished

    def _groups(self, ps: ProgramSet) -> dict[str, Group]:
        rank_of = self.plan.rank_of
        out: dict[str, Group] = {}
        for name, members in ps.barriers:
            ranks = sorted({rank_of[c] for c in members if c in rank_of})
            comm = None
            if len(ranks) > 1 and self.rank in ranks:
                grp = self.comm.Get_group().Incl(ranks)
                comm = self.comm.Create_group(grp)
                grp.Free()
            local = {c for c in members if rank_of.get(c) == self.rank}
            out[name] = Group(name, tuple(members), local, comm)
        return out

    # -- what the cores call ------------------------------------------------------------------
    def decl_shape(self, name: str) -> tuple[int, ...] | None:
        d = self.decls.get(name)
        return None if d is None else tuple(d.shape)

    def decl_dtype(self, name: str) -> str:
        return self.decls[name].dtype

    def barrier(self, name: str, core: int) -> Group:
        g = self.groups.get(name)
        if g is None:
            raise MpiError(f"core {core}: barrier group {name!r} is not declared")
        if core not in g.local:
            raise MpiError(f"core {core} is not a member of barrier group {name!r} {g.members}")
        return g

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Run until every rank's cores finished; raise the run's error or deadlock."""
        try:
            self._loop()
        except (SimulationError, KeyError, ValueError, IndexError, TypeError) as exc:
            if isinstance(exc, _Stop):
                raise exc.error from None
            err = (
                exc
                if isinstance(exc, SimulationError)
                else MpiError(f"rank {self.rank}: {type(exc).__name__}: {exc}")
            )
            self._fail(err)

    def _fail(self, err: SimulationError) -> None:
        kind = (
            "deadlock"
            if isinstance(err, DeadlockError)
            else ("mpi" if isinstance(err, MpiError) else "simulation")
        )
        if self.rank == 0:
            self._broadcast(_ABORT, (kind, str(err)))
            raise err
        self.ctrl.isend((kind, str(err)), dest=0, tag=_ERROR)
        while True:  # wait for the root to stop every rank
            msg = self.ctrl.improbe(self.MPI.ANY_SOURCE, _ABORT)
            if msg is not None:
                kind, text = msg.recv()
                raise _ERRORS[kind](text)
            self.net.poll()
            time.sleep(0.001)

    def _broadcast(self, tag: int, obj: Any) -> None:
        reqs = [self.ctrl.isend(obj, dest=r, tag=tag) for r in range(1, self.size)]
        self.MPI.Request.Waitall(reqs)

    def _loop(self) -> None:
        running = list(self.cores)
        waits: dict[int, tuple] = {}
        t0 = last = time.perf_counter()
        seen = -1
        sleep = 0.0
        coord = _Coordinator(self) if self.rank == 0 else None
        while True:
            for core in running:
                try:
                    w = next(core.steps)
                except StopIteration:
                    waits.pop(core.id, None)
                    continue
                if w is not None:
                    waits[core.id] = w
                else:
                    waits.pop(core.id, None)
            running = [c for c in running if not c.done]
            if not running and self.finish_s is None:
                self.finish_s = time.perf_counter() - t0
            for g in self.groups.values():
                if g.poll():
                    self.progress += 1
            if self.net.poll():
                self.progress += 1
            now = time.perf_counter()
            if self.progress != seen:
                seen, last, sleep = self.progress, now, 0.0
            else:
                # nothing moved: back off so oversubscribed ranks share the cores
                sleep = min(_MAX_SLEEP, sleep * 2 or 1e-5)
                time.sleep(sleep)
                if running:  # idle: its cores wait (not: they finished, the run goes on)
                    self.idle_s += time.perf_counter() - now
            self.rounds += 1
            pending = self.net.pending_sends()
            finished = not running and not pending
            stalled = bool(running or pending) and now - last >= self.timeout
            state = (finished, stalled, running, waits)
            if coord is not None:
                if coord.step(state, now):
                    return
            elif self._serve(state):
                return

    def state(self, finished: bool, stalled: bool, running: list, waits: dict) -> dict:
        """This rank's answer to the root: finished / blocked and, when either, on what."""
        st: dict = {"rank": self.rank, "finished": finished, "stalled": stalled}
        if finished or stalled:  # the details a report or the final check needs
            st["blocked"] = [(c.id, describe(c.ins), waits.get(c.id, ("?",))) for c in running]
            st["done"] = [c.id for c in self.cores if c.done]
            st["arrived"] = {g.name: sorted(g.arrived) for g in self.groups.values()}
            st["leftovers"] = self.net.leftovers() if finished else {}
        return st

    def _serve(self, state: tuple) -> bool:
        """A non-root rank answers the root's queries; True once the root says done."""
        MPI = self.MPI
        while True:
            status = MPI.Status()
            msg = self.ctrl.improbe(0, MPI.ANY_TAG, status)
            if msg is None:
                return False
            tag, obj = status.Get_tag(), msg.recv()
            if tag == _QUERY:
                self.ctrl.isend((obj, self.state(*state)), dest=0, tag=_ANSWER)
            elif tag == _DONE:
                return True
            elif tag == _ABORT:
                raise _Stop(_ERRORS[obj[0]](obj[1]))


class _Stop(SimulationError):
    """The root stopped the run with ``error`` (raised again on this rank)."""

    def __init__(self, error: SimulationError) -> None:
        super().__init__(str(error))
        self.error = error


class _Coordinator:
    """The root's side of termination and deadlock detection (module docstring)."""

    def __init__(self, rr: RankRun) -> None:
        self.rr = rr
        self.epoch = 0
        self.answers: dict[int, dict] | None = None
        self.next_t = 0.0
        self.leftover_rounds = 0
        self.undecided = 0

    def step(self, state: tuple, now: float) -> bool:
        rr = self.rr
        MPI = rr.MPI
        status = MPI.Status()
        while True:  # errors and answers from the other ranks
            msg = rr.ctrl.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                break
            tag, obj = status.Get_tag(), msg.recv()
            if tag == _ERROR:
                raise _ERRORS[obj[0]](obj[1])
            if tag == _ANSWER and self.answers is not None and obj[0] == self.epoch:
                self.answers[status.Get_source()] = obj[1]
        finished, stalled = state[0], state[1]
        if self.answers is None:
            if not (finished or stalled) or now < self.next_t:
                return False
            self.epoch += 1
            self.answers = {}
            for r in range(1, rr.size):
                rr.ctrl.isend(self.epoch, dest=r, tag=_QUERY)
        if len(self.answers) < rr.size - 1:
            return False
        states = [rr.state(*state), *(self.answers[r] for r in sorted(self.answers))]
        self.answers = None
        if all(s["finished"] for s in states):
            left = {k: n for s in states for k, n in s["leftovers"].items()}
            if not left:
                rr._broadcast(_DONE, None)
                return True
            self.leftover_rounds += 1
            if self.leftover_rounds >= 20:  # credits had time to arrive: never received
                (name, dst), n = sorted(left.items())[0]
                src = rr.net.chans[name].src
                raise MpiError(
                    f"channel {name!r}: {n} message(s) from core {src} were never received by "
                    f"core {dst}; add the matching Recv or drop the Send"
                )
            self.next_t = now + 0.01
            return False
        self.leftover_rounds = 0
        if all(s["finished"] or s["stalled"] for s in states):
            raise DeadlockError(deadlock_report(rr, states))
        # ask again soon, then less often while some rank is still running
        self.undecided += 1
        self.next_t = now + min(0.01 * 2 ** min(self.undecided, 3), rr.timeout / 4)
        return False


def _why(wait: tuple, rr: RankRun, finished: set[int], arrived: dict[str, set[int]]) -> str:
    kind = wait[0]
    chans = rr.net.chans
    if kind in ("buf", "value"):
        ch = chans[wait[-1]]
        target = f"buffer {wait[1]!r}" if kind == "buf" else "a control value"
        state = (
            f"core {ch.src} finished without sending it"
            if ch.src in finished
            else "no message has been sent on it yet"
        )
        return (
            f"waits for {target} from a receive on channel {ch.name!r} (sent by core {ch.src}); "
            f"{state}"
        )
    if kind == "credit":
        name, dst = wait[1], wait[2]
        done = f" (core {dst} has finished)" if dst in finished else ""
        return (
            f"waits for space in the FIFO of channel {name!r} to core {dst}: all "
            f"{rr.net.depth[name]} slots hold messages core {dst} has not received{done}"
        )
    if kind == "barrier":
        members = dict(rr.ps.barriers)[wait[1]]
        here = arrived.get(wait[1], set())
        missing = [c for c in members if c not in here]
        return f"waits at barrier {wait[1]!r} for cores {missing}"
    if kind == "any":
        return f"waits for a message on any of channels {list(wait[1])}"
    return "waits (unknown)"


def deadlock_report(rr: RankRun, states: list[dict]) -> str:
    """Who waits on whom across all ranks, in the simulator's words."""
    finished = {c for s in states for c in s["done"]}
    arrived: dict[str, set[int]] = {}
    for s in states:
        for g, cores in s["arrived"].items():
            arrived.setdefault(g, set()).update(cores)
    stuck = sorted((c, ins, w, s["rank"]) for s in states for c, ins, w in s["blocked"])
    lines = [
        f"deadlock on {rr.size} MPI rank(s), no progress for {rr.timeout:g} s: {len(stuck)} "
        f"core(s) are blocked and nothing is in flight (program set {rr.ps.name!r})"
    ]
    for core, ins, wait, rank in stuck:
        name = core_name(rr.chip, core) if rr.chip is not None else f"core {core}"
        lines.append(f"  {name} at `{ins}` {_why(wait, rr, finished, arrived)} [rank {rank}]")
    lines.append(
        "Each core waits on another: reorder Sends before the Recvs they feed, make FIFOs "
        "deeper, or make every barrier member reach the barrier."
    )
    return "\n".join(lines)
