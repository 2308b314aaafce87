"""The configurations of a split layer, reported in worker processes side by side.

A layer cut into sequential configurations (:mod:`torch2step.configurations`) runs them one
after another on the chip, but each one's report is independent of the others': it reads its
inputs from HBM, and the values that steer its control are computed from the layer's own
stand-ins, not from an earlier configuration's run.  So the reports (lowering, the timing run
of the interpreter, the spatial plan, the FIFO search and the simulation) can be made in
parallel and put together in order; the result is the same, configuration for configuration,
as making them one after another.

:func:`run_groups` does that with forked worker processes (the layer, its stand-in values and
the compiled program are inherited, not pickled; each report comes back pickled, without the
per-core programs it ran).  Workers: the CPUs this process may use, at most one per
configuration; ``TORCH2STEP_JOBS=1`` makes the reports in this process one after another
(``TORCH2STEP_JOBS=N`` sets the number).  Where ``fork`` is not available the reports are
made in this process.

A configuration that does not fit once its buffers are counted is halved (its error is a
:class:`~torch2step.errors.ScheduleError`); the halves take its place and the configurations
after it are renumbered, as in the one-after-another order.  The first error in configuration
order is the one raised.  A later configuration's failure is acted on as soon as it is known,
not when the earlier ones are done: one of several operators is halved at once, and one of a
single operator, which cannot be halved, fails the whole report at once with its error (the
workers still running are stopped).

:func:`started` runs one call in a forked worker beside the process's own work (``torch2step
compare`` makes the spatial report there while it plans and simulates the kernel-by-kernel
execution), under the same ``TORCH2STEP_JOBS``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar

from torch2step.errors import InputError, ScheduleError

__all__ = ["JOBS_ENV", "Started", "jobs_for", "run_groups", "started"]

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Environment variable: worker processes for a split layer's configurations (module docstring).
JOBS_ENV = "TORCH2STEP_JOBS"

#: ``run(group, k)``: the report of configuration ``k`` (1-based) made of the layer operators at
#: positions ``group``, and what its program keeps for ``write_trace``; raises
#: :class:`ScheduleError` when the configuration does not fit the chip.
Runner = Callable[[tuple[int, ...], int], tuple[Any, Any]]
Done = list[tuple[tuple[int, ...], Any, Any]]


def jobs_for(n: int) -> int:
    """Worker processes for ``n`` configurations (module docstring)."""
    env = os.environ.get(JOBS_ENV, "").strip()
    if env:
        try:
            jobs = int(env)
        except ValueError:
            jobs = 0
        if jobs < 1:
            raise InputError(f"{JOBS_ENV}={env!r}: give a positive number of worker processes")
    else:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - platforms without affinity
            jobs = os.cpu_count() or 1
    return max(1, min(jobs, n))


def run_groups(run: Runner, groups: Sequence[Sequence[int]], jobs: int) -> Done:
    """The reports of ``groups`` (layer operator positions, in layer order) by ``run``, in
    order, halving a group that does not fit (module docstring), with ``jobs`` workers."""
    pending = [tuple(g) for g in groups]
    if jobs > 1 and len(pending) > 1 and "fork" in multiprocessing.get_all_start_methods():
        global _TASK
        _TASK = run
        ex = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"))
        failed = True
        try:
            done = _collect(lambda g, k: ex.submit(_in_worker, g, k), pending)
            failed = False
            return done
        except BrokenProcessPool as exc:  # a worker died (e.g. out of memory): go on here
            log.warning("configuration workers stopped (%s); reporting them one by one", exc)
        finally:
            if failed:  # reports nobody will read: do not let them take the CPUs
                _stop_workers(ex)
            ex.shutdown(wait=not failed, cancel_futures=failed)
            _TASK = None
    return _collect(lambda g, k: _Here(run, g, k), pending)


class _Here:
    """A report made in this process when its result is asked for: the one-after-another
    counterpart of a worker's ``Future`` (:func:`_collect` asks in configuration order)."""

    def __init__(self, run: Runner, group: tuple[int, ...], k: int) -> None:
        self.call = (run, group, k)

    def result(self) -> tuple[Any, Any]:
        run, group, k = self.call
        return run(group, k)

    def cancel(self) -> bool:
        return True


def _collect(submit: Callable[[tuple[int, ...], int], Any], pending: list[tuple[int, ...]]) -> Done:
    """The reports of ``pending``, each from ``submit(group, k)`` (a ``Future`` or
    :class:`_Here`), taken in order: a group that does not fit is replaced by its halves and
    the configurations after it are submitted again, renumbered; the first error in
    configuration order is raised (but see :func:`_settle_later`)."""
    slots = [(g, submit(g, k)) for k, g in enumerate(pending, 1)]
    done: Done = []
    while len(done) < len(slots):
        i = len(done)
        _settle_later(slots, i, submit)
        group, fut = slots[i]
        try:
            rep, last = fut.result()
        except ScheduleError:
            if len(group) == 1:
                raise
            _halve(slots, i, submit)
            continue
        done.append((group, rep, last))
    return done


Slots = list[tuple[tuple[int, ...], Any]]


def _halve(slots: Slots, i: int, submit: Callable[[tuple[int, ...], int], Any]) -> None:
    """Replace configuration ``i``, which did not fit, by its halves; those after it are
    submitted again, renumbered."""
    group = slots[i][0]
    half = len(group) // 2
    rest = [g for g, _ in slots[i + 1 :]]
    for _, later in slots[i + 1 :]:
        later.cancel()
    groups = [group[:half], group[half:], *rest]
    slots[i:] = [(g, submit(g, i + 1 + j)) for j, g in enumerate(groups)]


def _settle_later(slots: Slots, i: int, submit: Callable[[tuple[int, ...], int], Any]) -> None:
    """While configuration ``i``'s report is made by a worker, act on the later ones that do
    not fit as soon as they fail: one of several operators is halved at once, one of a single
    operator raises its error (module docstring)."""
    head = slots[i][1]
    if not isinstance(head, Future):
        return
    while not head.done():
        for j in range(i + 1, len(slots)):
            group, fut = slots[j]
            if fut.done() and not fut.cancelled() and isinstance(fut.exception(), ScheduleError):
                if len(group) == 1:
                    raise fut.exception()  # type: ignore[misc]
                _halve(slots, j, submit)
                break
        else:
            running = [f for _, f in slots[i:] if isinstance(f, Future) and not f.done()]
            wait(running, return_when=FIRST_COMPLETED)


def _stop_workers(ex: ProcessPoolExecutor) -> None:
    """Stop the executor's worker processes, their reports under way included."""
    stop = getattr(ex, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    for proc in list((getattr(ex, "_processes", None) or {}).values()):
        proc.terminate()


#: What a forked worker runs (:func:`_in_worker`), set while its workers are forked.
_TASK: Callable[..., Any] | None = None


def _in_worker(*args: Any) -> Any:
    import torch

    from runtime.engine import progress

    assert _TASK is not None, "worker started without its task"
    # one thread: the parent's OpenMP pool is not usable after a fork (a parallel region in
    # the child would wait for threads that are not there), and the workers fill the CPUs
    torch.set_num_threads(1)
    with progress(None):  # the parent's progress bar is not the worker's to draw
        return _TASK(*args)


class Started(Generic[T]):
    """A call started by :func:`started`: calling it waits for the call's result (or makes the
    call here, when it was not started in a worker); :meth:`cancel` gives it up."""

    def __init__(
        self, fn: Callable[[], T], ex: ProcessPoolExecutor | None = None, fut: Future | None = None
    ) -> None:
        self._fn, self._ex, self._fut = fn, ex, fut

    @property
    def in_worker(self) -> bool:
        """Whether the call runs in a worker process (beside this one), not yet given up."""
        return self._ex is not None and self._fut is not None

    def __call__(self) -> T:
        if self._ex is None or self._fut is None:
            return self._fn()
        try:
            return self._fut.result()  # type: ignore[no-any-return]
        except BrokenProcessPool as exc:  # the worker died (e.g. out of memory): call here
            log.warning("worker process stopped (%s); running it here", exc)
            return self._fn()
        finally:  # the worker has finished: join it
            self._ex.shutdown(wait=True, cancel_futures=True)

    def cancel(self) -> None:
        """Give the call up: its worker, if it has one, is stopped."""
        if self._ex is not None:
            _stop_workers(self._ex)
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None


def started(fn: Callable[[], T]) -> Started[T]:
    """``fn()`` started in a forked worker process, to run beside what this process does next
    (e.g. ``torch2step compare``'s two executions); returns the call that waits for its
    result.  Without a second worker (``TORCH2STEP_JOBS=1``, one CPU, no ``fork``, or in a
    daemonic process, which may not have children) the returned call makes the call itself, in
    this process.  ``fn``'s result must pickle."""
    if (
        jobs_for(2) < 2
        or "fork" not in multiprocessing.get_all_start_methods()
        or multiprocessing.current_process().daemon
    ):
        return Started(fn)
    global _TASK
    _TASK = fn
    ex = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
    try:
        fut = ex.submit(_in_worker)  # the worker is forked here, with _TASK set
    finally:
        _TASK = None
    return Started(fn, ex, fut)
