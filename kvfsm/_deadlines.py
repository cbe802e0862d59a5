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

`arm` and `disarm` are what the generic status hooks call. The compiled
engine inlines the same two steps into its generated code instead (see
`inline_arm` / `inline_disarm` and `_machine.py`), specialised per phase: a
phase without a timeout costs nothing at all there.

An `OrderedDict` rather than a plain dict on purpose: a dict keeps the
holes of deleted keys at its front until its next resize, so finding the
head after many rooms left (or timed out) could scan O(n) holes on every
check. The ordered dict's linked list finds the head in O(1) always.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Generic, Protocol, TypeVar

from ._states import NON_TERMINAL, KVPoll, RoomId, Timeouts

__all__ = ["PhaseDeadlines"]


class _Timed(Protocol):
    @property
    def room(self) -> RoomId: ...

    entered_at: float


R = TypeVar("R", bound=_Timed)


class PhaseDeadlines(Generic[R]):
    """The armed deadlines of every live room, one FIFO per phase."""

    __slots__ = ("_limits", "_queues", "next_due")

    def __init__(self, timeouts: Timeouts) -> None:
        # Indexed by KVPoll value; None where the phase has no deadline.
        self._limits: list[float | None] = [None] * len(KVPoll)
        # Keyed by room id, not by record: ids are often sequential, so the
        # queue's hash table is walked in order (the record's hash is its
        # address, which scatters over memory at a million rooms).
        self._queues: list[OrderedDict[RoomId, R] | None] = [None] * len(KVPoll)
        for state in NON_TERMINAL:
            limit = timeouts.for_state(state)
            if limit is not None:
                self._limits[state] = float(limit)
                self._queues[state] = OrderedDict()
        #: Earliest armed deadline (may be early after a room left its phase;
        #: `due` then recomputes it). `inf` when nothing is armed.
        self.next_due = math.inf

    def arm(self, room: R, state: KVPoll, now: float) -> None:
        """`room` just entered `state` at `now`."""
        queue = self._queues[state]
        if queue is not None:
            queue[room.room] = room
            due = now + self._limits[state]  # type: ignore[operator]
            if due < self.next_due:
                self.next_due = due

    def disarm(self, room: R, state: KVPoll) -> None:
        """`room` is leaving `state`."""
        queue = self._queues[state]
        if queue is not None:
            queue.pop(room.room, None)

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
            for room in queue.values():
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
                head = next(iter(queue.values()))
                due = head.entered_at + self._limits[state]  # type: ignore[operator]
                if due < earliest:
                    earliest = due
        self.next_due = earliest

    # -- the compiled engine's view -------------------------------------------------

    def inline_names(self) -> dict[str, Any]:
        """The objects `inline_arm`/`inline_disarm` code refers to, by name."""
        names: dict[str, Any] = {"deadlines": self}
        for state in NON_TERMINAL:
            queue = self._queues[state]
            if queue is not None:
                names[f"deadline_queue_{state.value}"] = queue
                names[f"deadline_limit_{state.value}"] = self._limits[state]
        return names

    def inline_arm(self, state: KVPoll) -> list[str]:
        """`arm(room, state, now)` as source lines, for this table's limits."""
        if self._queues[state] is None:
            return []
        return [
            f"deadline_queue_{state.value}[room.room] = room",
            f"due = now + deadline_limit_{state.value}",
            "if due < deadlines.next_due:",
            "    deadlines.next_due = due",
        ]

    def inline_disarm(self, state: KVPoll) -> list[str]:
        """`disarm(room, state)` as source lines (the room is always armed here)."""
        if self._queues[state] is None:
            return []
        return [f"del deadline_queue_{state.value}[room.room]"]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues if q is not None)
