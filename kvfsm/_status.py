"""The shared status table and the hooks that are its only writers (rule 1).

`StatusTable` is what a scheduler reads: room -> `KVPoll`, plus live counts
per state and the lifecycle counters. The functions named `enter_*` and
`exit_*` below are registered as the `transitions` machine's on-enter and
on-exit callbacks (see `_machine.py`). They, and `retire` (which forgets a
closed room), are the only code that touches the table. The manager decides
*whether* an event applies; these hooks are *how* a state change lands.

Each hook takes `(room, now, reason)`: the room's record (its handle), the
clock reading of the event, and the `FailureReason` for events that fail a
room (None otherwise). The machine passes them as trigger arguments, so
both engines call exactly these functions with exactly these values.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from ._deadlines import PhaseDeadlines
from ._states import FailureKind, FailureReason, KVPoll, RoomId, Timeouts

__all__ = ["ManagerStats", "StatusTable", "RoomRecord", "Hook"]


@attrs.define(slots=True, eq=False)
class ManagerStats:
    """Lifecycle counters of one manager since it was created.

    `late_events` counts every event that arrived for a terminal or closed
    room and was absorbed (rule 2 and 4); `stale_events` is the part of them
    that came through the handle of a closed generation. `invalid_events`
    counts out-of-order events (rule 3). `final_states` and `failure_kinds`
    count rooms by how they ended.
    """

    opened: int = 0
    closed: int = 0
    late_events: int = 0
    stale_events: int = 0
    invalid_events: int = 0
    timeouts: int = 0
    aborts: int = 0
    drain_deadline_releases: int = 0
    final_states: dict[KVPoll, int] = attrs.Factory(lambda: {KVPoll.Success: 0, KVPoll.Failed: 0})
    failure_kinds: dict[FailureKind, int] = attrs.Factory(lambda: {kind: 0 for kind in FailureKind})


class RoomRecord(Protocol):
    """What the hooks need of a room's record (the handle implements it)."""

    room: RoomId
    state: KVPoll
    reason: FailureReason | None
    entered_at: float
    transfer_started_at: float | None
    finished_at: float | None

    @property
    def _table(self) -> StatusTable: ...


class Hook(Protocol):
    def __call__(self, room: RoomRecord, now: float, reason: FailureReason | None, /) -> None: ...


class StatusTable:
    """room -> KVPoll for every open room, with live counts and deadlines."""

    __slots__ = ("deadlines", "live", "stats", "status")

    def __init__(self, timeouts: Timeouts) -> None:
        self.status: dict[RoomId, KVPoll] = {}
        #: Open rooms per state, indexed by KVPoll value.
        self.live: list[int] = [0] * len(KVPoll)
        self.deadlines: PhaseDeadlines[RoomRecord] = PhaseDeadlines(timeouts)
        self.stats = ManagerStats()


def _enter(room: RoomRecord, now: float) -> StatusTable:
    table = room._table
    state = room.state
    table.status[room.room] = state
    table.live[state] += 1
    room.entered_at = now
    return table


def enter_phase(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Entering Bootstrapping or WaitingForInput: sync status, arm the deadline."""
    _enter(room, now).deadlines.arm(room, room.state, now)


def enter_transferring(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Entering Transferring: also the start of the transfer-latency window."""
    room.transfer_started_at = now
    _enter(room, now).deadlines.arm(room, room.state, now)


def exit_phase(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Leaving a non-terminal state: it no longer counts, its deadline is off."""
    table = room._table
    table.live[room.state] -= 1
    table.deadlines.disarm(room, room.state)


def enter_success(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    room.finished_at = now
    _enter(room, now).stats.final_states[KVPoll.Success] += 1


def enter_failed(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    if reason is None:  # pragma: no cover - the manager always supplies one
        raise AssertionError(f"room {room.room!r} entered Failed without a FailureReason")
    room.reason = reason
    room.finished_at = now
    stats = _enter(room, now).stats
    stats.final_states[KVPoll.Failed] += 1
    stats.failure_kinds[reason.kind] += 1


def retire(room: RoomRecord) -> None:
    """Forget a closed room: the table no longer lists it (rule 4)."""
    table = room._table
    del table.status[room.room]
    table.live[room.state] -= 1
    if room.state not in (KVPoll.Success, KVPoll.Failed):  # pragma: no cover - close aborts first
        table.deadlines.disarm(room, room.state)
    table.stats.closed += 1
    room.reason = None
