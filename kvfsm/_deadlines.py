"""Per-phase deadlines: one insertion-ordered queue per phase, O(1) per step.

Each phase (for the KV lifecycle: Bootstrapping, WaitingForInput, Transferring) has a single
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

The phases are the lifecycle's (`Lifecycle.phases`; one queue per live
state that has a deadline). One more queue holds the drain deadlines of
failed rooms whose pages wait for proof (the release phase, `_release.py`):
rooms fail in clock order too, so it is a FIFO as well. It holds records,
not room ids (a closed room's pages may still be draining while a new
generation of the same id is open), in a plain deque: arming is an append
(every abort pays it: an ordered-dict insert cost 29 % of an abort), and a
proof does not look for its entry; entries whose pages left draining are
skipped when they come due. So a failed room's record is kept at most
until its drain deadline.

An `OrderedDict` rather than a plain dict on purpose: a dict keeps the
holes of deleted keys at its front until its next resize, so finding the
head after many rooms left (or timed out) could scan O(n) holes on every
check. The ordered dict's linked list finds the head in O(1) always.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any, Generic, Protocol, TypeVar

from ._lifecycle import KV_LIFECYCLE, Lifecycle, PhaseTimeouts
from ._states import RoomId, State

__all__ = ["PhaseDeadlines"]


class _Timed(Protocol):
    @property
    def room(self) -> RoomId: ...

    entered_at: float
    finished_at: float | None


R = TypeVar("R", bound=_Timed)


class PhaseDeadlines(Generic[R]):
    """The armed deadlines of every live room, one FIFO per phase."""

    __slots__ = ("_drain_limit", "_drain_queue", "_limits", "_live", "_queues", "next_due")

    def __init__(self, timeouts: PhaseTimeouts, lifecycle: Lifecycle = KV_LIFECYCLE) -> None:
        size = len(lifecycle.State)
        self._live: tuple[State, ...] = lifecycle.non_terminal
        # Indexed by state value; None where the phase has no deadline.
        self._limits: list[float | None] = [None] * size
        # Keyed by room id, not by record: ids are often sequential, so the
        # queue's hash table is walked in order (the record's hash is its
        # address, which scatters over memory at a million rooms).
        self._queues: list[OrderedDict[RoomId, R] | None] = [None] * size
        for state in self._live:
            limit = timeouts.for_state(state)
            if limit is not None:
                self._limits[state] = float(limit)
                self._queues[state] = OrderedDict()
        drain = timeouts.drain
        self._drain_limit: float | None = None if drain is None else float(drain)
        # Failed rooms whose pages were draining when they failed, oldest failure first.
        self._drain_queue: deque[R] = deque()
        #: Earliest armed deadline (may be early after a room left its phase;
        #: `due` then recomputes it). `inf` when nothing is armed.
        self.next_due = math.inf

    def arm(self, room: R, state: State, now: float) -> None:
        """`room` just entered `state` at `now`."""
        queue = self._queues[state]
        if queue is not None:
            queue[room.room] = room
            due = now + self._limits[state]  # type: ignore[operator]
            if due < self.next_due:
                self.next_due = due

    def disarm(self, room: R, state: State) -> None:
        """`room` is leaving `state`."""
        queue = self._queues[state]
        if queue is not None:
            queue.pop(room.room, None)

    def arm_drain(self, room: R, now: float) -> None:
        """`room` failed at `now`: its pages wait for proof until the drain deadline."""
        if self._drain_limit is not None:
            queue = self._drain_queue
            if not queue:  # else next_due is at or before the head's deadline already
                due = now + self._drain_limit
                if due < self.next_due:
                    self.next_due = due
            queue.append(room)

    def disarm_drain(self, room: R) -> None:
        """`room`'s pages left draining: nothing to do now, its entry is skipped when it comes due."""

    def drain_due(self, now: float) -> list[R]:
        """Records whose drain deadline is at or before `now`, oldest first, taken off the queue.

        The caller steps those whose pages still drain; the others (a proof
        came meanwhile) are dropped here.
        """
        limit = self._drain_limit
        expired: list[R] = []
        queue = self._drain_queue
        while queue:
            head = queue[0]
            if head.finished_at is not None and head.finished_at + limit > now:  # type: ignore[operator]
                break
            expired.append(queue.popleft())
        return expired

    @property
    def drain_limit(self) -> float | None:
        return self._drain_limit

    def draining(self) -> int:
        """Rooms whose pages wait for proof with a drain deadline armed."""
        return len(self._drain_queue)

    def due(self, now: float) -> list[tuple[R, State, float]]:
        """Rooms whose deadline is at or before `now`, oldest first per phase.

        Returns (room, phase, limit) triples and leaves them armed: the
        caller fails each room, whose exit hook disarms it. Call `refresh`
        afterwards.
        """
        expired: list[tuple[R, State, float]] = []
        for state in self._live:
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
        """Recompute `next_due` from the head of each phase's queue and of the drain queue."""
        earliest = math.inf
        for state in self._live:
            queue = self._queues[state]
            if queue:
                head = next(iter(queue.values()))
                due = head.entered_at + self._limits[state]  # type: ignore[operator]
                if due < earliest:
                    earliest = due
        if self._drain_queue:
            failed = self._drain_queue[0].finished_at
            if failed is not None and failed + self._drain_limit < earliest:  # type: ignore[operator]
                earliest = failed + self._drain_limit  # type: ignore[operator]
        self.next_due = earliest

    # -- the compiled engine's view -------------------------------------------------

    def inline_names(self) -> dict[str, Any]:
        """The objects `inline_arm`/`inline_disarm` code refers to, by name."""
        names: dict[str, Any] = {
            "deadlines": self,
            "drain_queue": self._drain_queue,
            "drain_queue_append": self._drain_queue.append,
            "drain_limit": self._drain_limit,
        }
        for state in self._live:
            queue = self._queues[state]
            if queue is not None:
                names[f"deadline_queue_{state.value}"] = queue
                names[f"deadline_limit_{state.value}"] = self._limits[state]
        return names

    def inline_arm(self, state: State) -> list[str]:
        """`arm(room, state, now)` as source lines, for this table's limits."""
        if self._queues[state] is None:
            return []
        return [
            f"deadline_queue_{state.value}[room.room] = room",
            f"due = now + deadline_limit_{state.value}",
            "if due < deadlines.next_due:",
            "    deadlines.next_due = due",
        ]

    def inline_disarm(self, state: State) -> list[str]:
        """`disarm(room, state)` as source lines (the room is always armed here)."""
        if self._queues[state] is None:
            return []
        return [f"del deadline_queue_{state.value}[room.room]"]

    def inline_arm_drain(self) -> list[str]:
        """`arm_drain(room, now)` as source lines, for this table's drain limit."""
        if self._drain_limit is None:
            return []
        return [
            "if not drain_queue:",
            "    due = now + drain_limit",
            "    if due < deadlines.next_due:",
            "        deadlines.next_due = due",
            "drain_queue_append(room)",
        ]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues if q is not None)
