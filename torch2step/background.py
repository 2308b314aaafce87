"""A small computation made in a forked child process beside the process's own work.

:func:`beside` forks a child that computes ``fn()`` and sends the result back through a pipe,
while this process goes on; the returned :class:`Beside` gives the result when asked.  The
child runs at the lowest scheduling priority (``nice`` 19), so it takes a CPU only where one
is idle: a report's critical path (the interpreter's run, the spatial plan and the
simulation, one after another) keeps its core, and a split layer's configuration workers
(:mod:`torch2step.config_jobs`) keep theirs, while the second CPU, idle beside a single
process or once the shorter configuration is done, computes ``fn()``.

The result is exactly ``fn()``: the child is a copy of this process at the fork, running the
same code on the same objects.  When the result is asked for before the child has sent it (no
idle CPU came), this process waits for it with the child raised to its own priority, which is
no longer than computing ``fn()`` here; where raising it is not permitted, the child is stopped
and ``fn()`` called here.  A child that failed (e.g. ``fn`` raised) sends nothing, and
``fn()`` is called here, so a result (or ``fn``'s own exception) is always the one ``fn()``
gives in this process.  Without ``fork`` or a second CPU
(``TORCH2STEP_JOBS=1``, :func:`torch2step.config_jobs.jobs_for`) nothing is forked and
``fn()`` is called when the result is asked for.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Beside", "beside"]

T = TypeVar("T")

#: the child's niceness: the lowest priority (it runs on CPUs nothing else wants)
CHILD_NICE = 19


class Beside(Generic[T]):
    """``fn()`` under way in a forked child (or not started: ``pid`` None)."""

    def __init__(self, fn: Callable[[], T], pid: int | None, fd: int | None) -> None:
        self.fn, self.pid, self.fd = fn, pid, fd

    def result(self) -> T:
        """The child's result; when it is not done yet, the child is given this process's
        priority and waited for (or, where that is not permitted, stopped and ``fn()``
        computed here: module docstring)."""
        data = b""
        if self.fd is not None and self.pid is not None:
            if not select.select([self.fd], [], [], 0)[0] and not _as_urgent(self.pid):
                self.cancel()  # it would go on at the lowest priority: compute it here
            else:
                data = _read_all(self.fd)  # until the child has written all and exited
        self.cancel()
        if data[:1] == b"\x01":
            return pickle.loads(data[1:])  # type: ignore[no-any-return]
        return self.fn()  # not sent (not done, or failed): here, with fn's own errors

    def cancel(self) -> None:
        """Stop the child (if still running) and release it; idempotent."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = None


def _as_urgent(pid: int) -> bool:
    """Give the child ``pid`` this process's scheduling priority (this process is about to
    wait for it); False where that is not permitted (raising a priority may need privileges)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0))
    except OSError:
        return False
    return True


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def beside(fn: Callable[[], T]) -> Beside[T]:
    """``fn()`` started in a forked low-priority child process (module docstring); ``fn``'s
    result must pickle."""
    from torch2step.config_jobs import jobs_for

    if not hasattr(os, "fork") or jobs_for(2) < 2:
        return Beside(fn, None, None)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, leave without running the parent's exit code
        status = 0
        try:
            os.close(r)
            gc.disable()  # short-lived: what it allocates goes with the process
            os.nice(CHILD_NICE)
            data = b"\x01" + pickle.dumps(fn(), protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(data)
            while view:
                view = view[os.write(w, view) :]
        except BaseException:  # noqa: BLE001 - the parent computes it again and raises there
            status = 1
        finally:
            os._exit(status)
    os.close(w)
    return Beside(fn, pid, r)
