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

Each hook is written once, as a few lines of source (`status_hook`). The
compiled engine reads the machine's callbacks, takes these lines from each
and pastes them, specialised for one state and one table, into a single
generated function per transition: no call per hook, no lookups of
`room._table`, no branch on a phase without a deadline. The callable hook
that `transitions` runs (the reference engine) is compiled from the very
same lines, with the state read from the room and the table's objects
looked up through `room._table`; so a change to a hook is made once, and
the engine-equivalence property test (tests/property) proves that both
ways of running the lines give identical traces and status-table writes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol, cast

import attrs

from ._deadlines import PhaseDeadlines
from ._states import FailureKind, FailureReason, KVPoll, RoomId, Timeouts

__all__ = [
    "ManagerStats",
    "StatusTable",
    "RoomRecord",
    "Hook",
    "ARM",
    "DISARM",
    "TABLE_NAMES",
    "status_hook",
    "inline_lines",
]


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

#: The names hook lines may use for the table's objects: name -> path from the table.
TABLE_NAMES: dict[str, str] = {
    "status": "status",
    "live": "live",
    "stats": "stats",
    "final_states": "stats.final_states",
    "failure_kinds": "stats.failure_kinds",
}


def status_hook(name: str, doc: str, *lines: str) -> Hook:
    """A hook written once, as source lines; returns the callable made from them.

    The lines see `room`, `now`, `reason` (the hook's arguments) and the
    names of `TABLE_NAMES`; `{state}` is the state the hook runs for and
    `{index}` its value; a line `ARM` / `DISARM` is that phase's deadline
    bookkeeping. The compiled engine pastes the lines in specialised for one
    state and one table (`inline_lines`); the callable returned here runs
    them for any room, reading the state from `room.state` (the new state
    in an on-enter hook, the old one in an on-exit hook, as `transitions`
    calls them) and the table from `room._table`.
    """
    body: list[str] = []
    for line in lines:
        if line == ARM:
            body.append("table.deadlines.arm(room, room.state, now)")
        elif line == DISARM:
            body.append("table.deadlines.disarm(room, room.state)")
        else:
            body.append(line.format(state="room.state", index="room.state"))
    text = "\n".join(body)
    prologue = [f"{local} = table.{path}" for local, path in TABLE_NAMES.items() if re.search(rf"\b{local}\b", text)]
    if "table." in text or prologue:
        prologue.insert(0, "table = room._table")
    source = "\n".join([f"def {name}(room, now, reason, /):", *(f"    {line}" for line in prologue + body)]) + "\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<kvfsm status hook {name}>", "exec"), namespace)
    hook = namespace[name]
    hook.__doc__ = doc
    hook.__module__ = __name__
    hook.__kvfsm_inline__ = lines
    hook.__kvfsm_source__ = source
    return cast(Hook, hook)


def inline_lines(hook: object, state: KVPoll, table: StatusTable) -> list[str]:
    """`hook` running for `state` on `table`, as source lines (see `status_hook`)."""
    template: tuple[str, ...] | None = getattr(hook, "__kvfsm_inline__", None)
    if template is None:
        raise NotImplementedError(f"hook {hook!r} was not made by status_hook; the compiled engine cannot inline it")
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
        """What hook lines refer to, bound to this table's objects."""
        names: dict[str, Any] = {state.name: state for state in KVPoll}
        names.update({local: attrgetter(path)(self) for local, path in TABLE_NAMES.items()})
        names.update(self.deadlines.inline_names())
        return names


_ENTER = ("status[room.room] = {state}", "live[{index}] += 1", "room.entered_at = now")

enter_phase = status_hook(
    "enter_phase",
    "Entering Bootstrapping or WaitingForInput: sync status, arm the deadline.",
    *_ENTER,
    ARM,
)
enter_transferring = status_hook(
    "enter_transferring",
    "Entering Transferring: also the start of the transfer-latency window.",
    "room.transfer_started_at = now",
    *_ENTER,
    ARM,
)
exit_phase = status_hook(
    "exit_phase",
    "Leaving a non-terminal state: it no longer counts, its deadline is off.",
    "live[{index}] -= 1",
    DISARM,
)
enter_success = status_hook(
    "enter_success",
    "Entering Success: the room is finished and counted.",
    "room.finished_at = now",
    *_ENTER,
    "final_states[{state}] += 1",
)
record_failure = status_hook(
    "record_failure",
    """Before a room enters Failed (a `before` callback): record why.

    It runs before the state changes so that a reader who sees `Failed`
    without taking the manager's lock also sees the reason.
    """,
    "room.reason = reason",
)
enter_failed = status_hook(
    "enter_failed",
    "Entering Failed: finished, counted by final state and failure kind (the manager always gives a reason).",
    "room.finished_at = now",
    *_ENTER,
    "final_states[{state}] += 1",
    "failure_kinds[reason.kind] += 1",
)
retire = status_hook(
    "retire",
    """Forget a closed terminal room: the table no longer lists it (rule 4).

    Not a machine hook (closing is not a state change) but a writer of the
    table all the same, so it lives here with the others.
    """,
    "del status[room.room]",
    "live[room.state] -= 1",
    "stats.closed += 1",
    "room.reason = None",
)
