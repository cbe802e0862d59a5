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

The hooks are generic over lifecycles: which hook runs on which state is
derived from the state's declaration (`hooks_for`), the status table holds
the `KVPoll` each state reports (`{report}`), and the deadlines are the
lifecycle's phases. The release phase of a room's pages (`_release.py`)
is written here too: entering a success state releases the pages,
entering the failure state starts their drain, and `pages_step` is the
one writer of every later step (proof, quarantine, override).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Protocol, cast

import attrs

from ._deadlines import PhaseDeadlines
from ._lifecycle import KV_LIFECYCLE, Lifecycle, PhaseTimeouts
from ._release import RELEASE_TABLE, PagesState
from ._states import FailureKind, FailureReason, KVPoll, RoomId, State

__all__ = [
    "ManagerStats",
    "StatusTable",
    "RoomRecord",
    "Hook",
    "ARM",
    "DISARM",
    "ARM_DRAIN",
    "hooks_for",
    "pages_step",
    "held_nbytes",
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

    The release phase (`_release.py`): `quarantined` and
    `quarantined_bytes` are the rooms whose pages are quarantined now and
    the bytes they hold (gauges); `quarantines` counts every room that was
    quarantined, `released_after_quarantine` those a late proof released,
    `quarantine_overrides` those `release_quarantined()` released, `fences`
    the proofs that came as a fence, and `drain_deadline_releases` the
    rooms released by the drain deadline under the opt-in
    `on_drain_deadline="release"` (zero by default).
    """

    opened: int = 0
    closed: int = 0
    late_events: int = 0
    stale_events: int = 0
    invalid_events: int = 0
    timeouts: int = 0
    aborts: int = 0
    drain_deadline_releases: int = 0
    quarantined: int = 0
    quarantined_bytes: int = 0
    quarantines: int = 0
    released_after_quarantine: int = 0
    quarantine_overrides: int = 0
    fences: int = 0
    final_states: dict[State, int] = attrs.Factory(lambda: {KVPoll.Success: 0, KVPoll.Failed: 0})
    failure_kinds: dict[FailureKind, int] = attrs.Factory(lambda: {kind: 0 for kind in FailureKind})


class RoomRecord(Protocol):
    """What the hooks need of a room's record (the handle implements it)."""

    room: RoomId
    state: KVPoll  # or another lifecycle's state: see TransferHandle.state
    pages_state: PagesState
    pages_nbytes: int
    nbytes: int
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
#: Stands for a whole line: arm the room's drain deadline (its pages wait for proof).
ARM_DRAIN = "<arm drain deadline>"

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
    names of `TABLE_NAMES`; `{state}` is the state the hook runs for,
    `{index}` its value and `{report}` the `KVPoll` it reports; a line
    `ARM` / `DISARM` is that phase's deadline bookkeeping, `ARM_DRAIN` the
    drain deadline of a failed room's pages. `PAGES_<NAME>` are the
    release phase's states. The compiled engine pastes the lines in specialised for one
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
        elif line == ARM_DRAIN:
            body.append("table.deadlines.arm_drain(room, now)")
        else:
            body.append(line.format(state="room.state", index="room.state", report="table.reports[room.state]"))
    text = "\n".join(body)
    prologue = [f"{local} = table.{path}" for local, path in TABLE_NAMES.items() if re.search(rf"\b{local}\b", text)]
    if "table." in text or prologue:
        prologue.insert(0, "table = room._table")
    source = "\n".join([f"def {name}(room, now, reason, /):", *(f"    {line}" for line in prologue + body)]) + "\n"
    namespace: dict[str, Any] = {f"PAGES_{pages.name}": pages for pages in PagesState}
    exec(compile(source, f"<kvfsm status hook {name}>", "exec"), namespace)
    hook = namespace[name]
    hook.__doc__ = doc
    hook.__module__ = __name__
    hook.__kvfsm_inline__ = lines
    hook.__kvfsm_source__ = source
    return cast(Hook, hook)


def inline_lines(hook: object, state: State, table: StatusTable) -> list[str]:
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
        elif line == ARM_DRAIN:
            lines += table.deadlines.inline_arm_drain()
        else:
            lines.append(
                line.format(state=state_name(state), index=state.value, report=report_name(table.reports[state]))
            )
    return lines


def state_name(state: State) -> str:
    """The name a lifecycle state is bound to in generated code (`S_<name>`)."""
    return f"S_{state.name}"


def report_name(report: KVPoll) -> str:
    """The name a reported `KVPoll` is bound to in generated code (`P_<name>`)."""
    return f"P_{report.name}"


#: The status table is a plain dict; tests replace this to record every write.
new_status_map: Callable[[], dict[RoomId, KVPoll]] = dict


class StatusTable:
    """room -> reported KVPoll for every open room, with live counts per state and deadlines."""

    __slots__ = ("deadlines", "lifecycle", "live", "reports", "stats", "status", "terminal")

    def __init__(self, timeouts: PhaseTimeouts, lifecycle: Lifecycle = KV_LIFECYCLE) -> None:
        self.lifecycle = lifecycle
        self.status: dict[RoomId, KVPoll] = new_status_map()
        #: Open rooms per state, indexed by the lifecycle state's value.
        self.live: list[int] = [0] * len(lifecycle.State)
        #: The KVPoll each state reports, and whether it is terminal, by state value.
        self.reports: tuple[KVPoll, ...] = lifecycle.reports
        self.terminal: tuple[bool, ...] = tuple(state in lifecycle.terminal for state in lifecycle.State)
        self.deadlines: PhaseDeadlines[RoomRecord] = PhaseDeadlines(timeouts, lifecycle)
        self.stats = ManagerStats(final_states={state: 0 for state in (*lifecycle.successes, lifecycle.failure)})

    def inline_names(self) -> dict[str, Any]:
        """What hook lines refer to, bound to this table's objects."""
        names: dict[str, Any] = {state_name(state): state for state in self.lifecycle.State}
        names.update({report_name(report): report for report in KVPoll})
        names.update({f"PAGES_{pages.name}": pages for pages in PagesState})
        names.update({local: attrgetter(path)(self) for local, path in TABLE_NAMES.items()})
        names.update(self.deadlines.inline_names())
        return names


_ENTER = ("status[room.room] = {report}", "live[{index}] += 1", "room.entered_at = now")
# The release table's rows that entering a terminal state takes (the hooks below write them).
_SUCCEEDED = RELEASE_TABLE.row(PagesState.HELD, "succeeded")
_FAILED = RELEASE_TABLE.row(PagesState.HELD, "failed")
assert _SUCCEEDED is not None and _SUCCEEDED.dest is not None and _FAILED is not None and _FAILED.dest is not None

enter_phase = status_hook(
    "enter_phase",
    "Entering a live state (Bootstrapping, WaitingForInput, ...): sync status, arm the deadline.",
    *_ENTER,
    ARM,
)
enter_transferring = status_hook(
    "enter_transferring",
    "Entering a state that opens the transfer (Transferring): also the start of the transfer-latency window.",
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
    "Entering a success state: the room is finished and counted, and its pages are released.",
    "room.finished_at = now",
    *_ENTER,
    "final_states[{state}] += 1",
    f"room.pages_state = PAGES_{_SUCCEEDED.dest.name}",
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
    """Entering the failure state: finished, counted by final state and failure kind.

    The manager always gives a reason. The room's pages start draining:
    they wait for proof that no write can land, until the drain deadline.
    """,
    "room.finished_at = now",
    *_ENTER,
    "final_states[{state}] += 1",
    "failure_kinds[reason.kind] += 1",
    f"room.pages_state = PAGES_{_FAILED.dest.name}",
    ARM_DRAIN,
)
hold_pages = status_hook(
    "hold_pages",
    """Opening a room: its pages are held (in use) until the room ends.

    Not a machine hook (opening is not a transition) but the first writer of
    the release phase, so it lives here with the others.
    """,
    "room.pages_state = PAGES_HELD",
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


def hooks_for(lifecycle: Lifecycle, state: State) -> tuple[tuple[Hook, ...], tuple[Hook, ...]]:
    """(on-enter hooks, on-exit hooks) of `state`, derived from its declaration."""
    spec = lifecycle.spec(state)
    if spec.failure:
        return (enter_failed,), ()
    if spec.terminal:
        return (enter_success,), ()
    enter = enter_transferring if state in lifecycle.transfer_openers else enter_phase
    return (enter,), (exit_phase,)


def held_nbytes(room: RoomRecord) -> int:
    """The bytes a room's pages hold: what the backend said it gave (`holds`), else what was moved."""
    return room.pages_nbytes or room.nbytes


def pages_step(room: RoomRecord, input: str, table: StatusTable) -> PagesState | None:
    """Step the release phase of `room`'s pages by `input`; the state left, or None if not allowed.

    With `succeeded`/`failed` (written by the entry hooks above) the only
    writer of `room.pages_state`, and of the quarantine gauges. Called under
    the manager's lock.
    """
    before = room.pages_state
    row = RELEASE_TABLE.row(before, input)
    if row is None:
        return None
    dest = row.dest
    assert isinstance(dest, PagesState)
    stats = table.stats
    if before is PagesState.DRAINING:
        table.deadlines.disarm_drain(room)
    elif before is PagesState.QUARANTINED:
        stats.quarantined -= 1
        stats.quarantined_bytes -= held_nbytes(room)
    if dest is PagesState.QUARANTINED:
        stats.quarantined += 1
        stats.quarantines += 1
        stats.quarantined_bytes += held_nbytes(room)
    room.pages_state = dest
    return before
