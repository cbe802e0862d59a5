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

Each hook also carries its body as a few lines of source (`@inline`). The
compiled engine reads the machine's callbacks, takes these lines from each
and pastes them, specialised for one state and one table, into a single
generated function per transition: no call per hook, no lookups of
`room._table`, no branch on a phase without a deadline. Body and lines sit
next to each other so they are edited together, and the engine-equivalence
property test (tests/property) proves the two give identical traces and
identical status-table writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

from ._deadlines import PhaseDeadlines
from ._states import FailureKind, FailureReason, KVPoll, RoomId, Timeouts

__all__ = ["ManagerStats", "StatusTable", "RoomRecord", "Hook", "ARM", "DISARM", "inline", "inline_lines"]


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


#: Stands for a whole line: arm (or disarm) the phase deadline of `{state}`.
ARM = "<arm deadline>"
DISARM = "<disarm deadline>"

H = TypeVar("H", bound=Hook)


def inline(*lines: str) -> Callable[[H], H]:
    """Attach a hook's body as source lines the compiled engine can paste in.

    The lines see `room`, `now`, `reason` (the hook's arguments) and the
    names of `StatusTable.inline_names()`; `{state}` is the state the hook
    runs for (a name bound to the `KVPoll` member) and `{index}` its value.
    A line `ARM` / `DISARM` becomes that phase's deadline bookkeeping.
    """

    def attach(hook: H) -> H:
        hook.__kvfsm_inline__ = lines  # type: ignore[attr-defined]
        return hook

    return attach


def inline_lines(hook: object, state: KVPoll, table: StatusTable) -> list[str]:
    """`hook` running for `state` on `table`, as source lines (see `inline`)."""
    template: tuple[str, ...] | None = getattr(hook, "__kvfsm_inline__", None)
    if template is None:
        raise NotImplementedError(f"hook {hook!r} has no @inline body; the compiled engine cannot run it")
    lines: list[str] = []
    for line in template:
        if line == ARM:
            lines += table.deadlines.inline_arm(state)
        elif line == DISARM:
            lines += table.deadlines.inline_disarm(state)
        else:
            lines.append(line.format(state=state.name, index=state.value))
    return lines


#: The status table is a plain dict; tests replace this to record every write.
new_status_map: Callable[[], dict[RoomId, KVPoll]] = dict


class StatusTable:
    """room -> KVPoll for every open room, with live counts and deadlines."""

    __slots__ = ("deadlines", "live", "stats", "status")

    def __init__(self, timeouts: Timeouts) -> None:
        self.status: dict[RoomId, KVPoll] = new_status_map()
        #: Open rooms per state, indexed by KVPoll value.
        self.live: list[int] = [0] * len(KVPoll)
        self.deadlines: PhaseDeadlines[RoomRecord] = PhaseDeadlines(timeouts)
        self.stats = ManagerStats()

    def inline_names(self) -> dict[str, Any]:
        """What `@inline` lines refer to, bound to this table's objects."""
        names: dict[str, Any] = {state.name: state for state in KVPoll}
        names.update(
            status=self.status,
            live=self.live,
            stats=self.stats,
            final_states=self.stats.final_states,
            failure_kinds=self.stats.failure_kinds,
        )
        names.update(self.deadlines.inline_names())
        return names


_SUCCESS, _FAILED = KVPoll.Success, KVPoll.Failed


def _enter(room: RoomRecord, now: float) -> StatusTable:
    table = room._table
    state = room.state
    table.status[room.room] = state
    table.live[state] += 1
    room.entered_at = now
    return table


_ENTER = ("status[room.room] = {state}", "live[{index}] += 1", "room.entered_at = now")


@inline(*_ENTER, ARM)
def enter_phase(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Entering Bootstrapping or WaitingForInput: sync status, arm the deadline."""
    _enter(room, now).deadlines.arm(room, room.state, now)


@inline("room.transfer_started_at = now", *_ENTER, ARM)
def enter_transferring(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Entering Transferring: also the start of the transfer-latency window."""
    room.transfer_started_at = now
    _enter(room, now).deadlines.arm(room, room.state, now)


@inline("live[{index}] -= 1", DISARM)
def exit_phase(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Leaving a non-terminal state: it no longer counts, its deadline is off."""
    table = room._table
    table.live[room.state] -= 1
    table.deadlines.disarm(room, room.state)


@inline("room.finished_at = now", *_ENTER, "final_states[{state}] += 1")
def enter_success(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    room.finished_at = now
    _enter(room, now).stats.final_states[_SUCCESS] += 1


@inline("room.reason = reason")
def record_failure(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Before a room enters Failed (a `before` callback): record why.

    It runs before the state changes so that a reader who sees `Failed`
    without taking the manager's lock also sees the reason.
    """
    room.reason = reason


@inline(
    "room.finished_at = now",
    *_ENTER,
    "final_states[{state}] += 1",
    "failure_kinds[reason.kind] += 1",
)
def enter_failed(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    if reason is None:  # pragma: no cover - the manager always supplies one
        raise AssertionError(f"room {room.room!r} entered Failed without a FailureReason")
    room.finished_at = now
    stats = _enter(room, now).stats
    stats.final_states[_FAILED] += 1
    stats.failure_kinds[reason.kind] += 1


@inline("del status[room.room]", "live[room.state] -= 1", "stats.closed += 1", "room.reason = None")
def retire(room: RoomRecord, now: float, reason: FailureReason | None, /) -> None:
    """Forget a closed terminal room: the table no longer lists it (rule 4).

    Not a machine hook (closing is not a state change) but a writer of the
    table all the same, so it lives here with the others.
    """
    table = room._table
    del table.status[room.room]
    table.live[room.state] -= 1
    table.stats.closed += 1
    room.reason = None
