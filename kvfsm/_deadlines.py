"""Per-phase deadlines: one insertion-ordered queue per phase, O(1) per step.

Each phase (Bootstrapping, WaitingForInput, Transferring) has a single
timeout, and rooms enter a phase in clock order, so within one phase the
room that entered first is always the one due first. An insertion-ordered
mapping per phase is therefore already sorted by deadline: arming appends,
leaving a phase deletes in O(1) (no stale entries pile up behind a slow
room), and the earliest deadline is the first key. `next_due` caches the
earliest deadline over all phases so the hot path (every event and status
read) costs one float comparison when nothing is due.

Pure bookkeeping: no clock, no threads, no IO. The manager owns the clock
and the lock and calls in here under that lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from ._states import NON_TERMINAL, KVPoll, Timeouts

__all__ = ["PhaseDeadlines"]


class _Timed(Protocol):
    entered_at: float


R = TypeVar("R", bound=_Timed)


class PhaseDeadlines(Generic[R]):
    """The armed deadlines of every live room, one FIFO per phase."""

    __slots__ = ("_limits", "_queues", "next_due")

    def __init__(self, timeouts: Timeouts) -> None:
        # Indexed by KVPoll value; None where the phase has no deadline.
        self._limits: list[float | None] = [None] * len(KVPoll)
        self._queues: list[OrderedDict[R, None] | None] = [None] * len(KVPoll)
        for state in NON_TERMINAL:
            limit = timeouts.for_state(state)
            if limit is not None:
                self._limits[state] = float(limit)
                self._queues[state] = OrderedDict()
        #: Earliest armed deadline (may be early after a room left its phase;
        #: `due` then recomputes it). `inf` when nothing is armed.
        self.next_due = math.inf

    def limit(self, state: KVPoll) -> float | None:
        """The timeout of `state`'s phase, or None."""
        return self._limits[state]

    def arm(self, room: R, state: KVPoll, now: float) -> None:
        """`room` just entered `state` at `now`."""
        queue = self._queues[state]
        if queue is not None:
            queue[room] = None
            due = now + self._limits[state]  # type: ignore[operator]
            if due < self.next_due:
                self.next_due = due

    def disarm(self, room: R, state: KVPoll) -> None:
        """`room` is leaving `state`."""
        queue = self._queues[state]
        if queue is not None:
            queue.pop(room, None)

    def due(self, now: float) -> list[tuple[R, KVPoll, float]]:
        """Rooms whose deadline is at or before `now`, oldest first per phase.

        Returns (room, phase, limit) triples and leaves them armed: the
        caller fails each room, whose exit hook disarms it. Call `refresh`
        afterwards.
        """
        expired: list[tuple[R, KVPoll, float]] = []
        for state in NON_TERMINAL:
            queue = self._queues[state]
            if not queue:
                continue
            limit = self._limits[state]
            assert limit is not None
            for room in queue:
                if room.entered_at + limit > now:
                    break
                expired.append((room, state, limit))
        return expired

    def refresh(self) -> None:
        """Recompute `next_due` from the head of each phase's queue."""
        earliest = math.inf
        for state in NON_TERMINAL:
            queue = self._queues[state]
            if queue:
                head = next(iter(queue))
                due = head.entered_at + self._limits[state]  # type: ignore[operator]
                if due < earliest:
                    earliest = due
        self.next_due = earliest

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues if q is not None)
