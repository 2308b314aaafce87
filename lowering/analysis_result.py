"""What the static analysis of per-core programs finds (:mod:`lowering.analysis`): per-core
message, byte and barrier counts, the SRAM peak, and the problems found (Cyclotron §6: every
receive has a matching send, known before running).

A count is an ``int`` when every enclosing loop has a literal count and both arms of every
enclosing branch agree; ``None`` when it depends on run-time values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Count", "CoreAnalysis", "ProgramAnalysis", "add_counts", "mul_counts"]

#: A static count, or ``None`` when it depends on run-time values.
Count = int | None


def add_counts(a: Count, b: Count) -> Count:
    return None if a is None or b is None else a + b


def mul_counts(a: Count, b: Count) -> Count:
    return None if a is None or b is None else a * b


@dataclass(frozen=True, slots=True)
class CoreAnalysis:
    """What one core's program does, statically.

    ``sends`` / ``recvs`` map ``(channel, kind)`` (kind ``"data"`` or ``"value"``) to message
    counts; ``sent_bytes`` maps a channel to the bytes sent (capacity of the sent buffers);
    ``barriers`` maps a group to the number of arrivals; ``peak_buffers`` are the buffers live at
    the SRAM peak, as ``(name, bytes)``."""

    core: int
    peak_sram_bytes: int
    peak_buffers: tuple[tuple[str, int], ...]
    sends: Mapping[tuple[str, str], Count]
    recvs: Mapping[tuple[str, str], Count]
    sent_bytes: Mapping[str, Count]
    barriers: Mapping[str, Count]
    compute_dtypes: frozenset[str]


@dataclass(frozen=True, slots=True)
class ProgramAnalysis:
    """Per-core analyses plus the problems found inside programs (undeclared names, buffers
    used before ``Alloc`` or after ``Free``, undefined registers, unknown kernels...)."""

    cores: tuple[CoreAnalysis, ...]
    problems: tuple[str, ...]

    def core(self, core: int) -> CoreAnalysis:
        """The analysis of ``core``'s program."""
        for c in self.cores:
            if c.core == core:
                return c
        raise KeyError(core)

    def messages_sent(self, channel: str) -> Count:
        """Messages (data and values) sent on ``channel`` by all programs."""
        total: Count = 0
        for c in self.cores:
            for (name, _), n in c.sends.items():
                if name == channel:
                    total = add_counts(total, n)
        return total

    def messages_received(self, channel: str, core: int) -> Count:
        """Messages (data and values) ``core`` receives from ``channel``."""
        total: Count = 0
        for (name, _), n in self.core(core).recvs.items():
            if name == channel:
                total = add_counts(total, n)
        return total

    def bytes_sent(self, channel: str) -> Count:
        """Bytes sent on ``channel`` (per destination; a multicast delivers them to each)."""
        total: Count = 0
        for c in self.cores:
            total = add_counts(total, c.sent_bytes.get(channel, 0))
        return total
