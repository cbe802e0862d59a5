"""Each status hook is written once: the callable and the inlined lines come from one definition."""

from __future__ import annotations

from typing import Any

import pytest

from kvfsm import FailureKind, FailureReason, KVPoll, RoomId, Timeouts, _status
from kvfsm._release import PagesState
from kvfsm._status import ARM, StatusTable, inline_lines, status_hook


class _Record:
    def __init__(self, table: StatusTable, room: int, state: KVPoll) -> None:
        self.room: RoomId = room
        self.state = state
        self.reason: FailureReason | None = None
        self.entered_at = 0.0
        self.transfer_started_at: float | None = None
        self.finished_at: float | None = None
        self.pages_state = PagesState.HELD
        self.pages_nbytes = self.nbytes = 0
        self._table = table


def _run_lines(lines: list[str], table: StatusTable, record: _Record, now: float, reason: Any) -> None:
    namespace = table.inline_names()
    source = "def step(room, now, reason):\n" + "".join(f"    {line}\n" for line in lines or ["pass"])
    exec(compile(source, "<test>", "exec"), namespace)
    namespace["step"](record, now, reason)


def _snapshot(table: StatusTable, record: _Record) -> tuple[object, ...]:
    queues = tuple(tuple(q) if q is not None else None for q in table.deadlines._queues)
    return (
        dict(table.status),
        list(table.live),
        dict(table.stats.final_states),
        dict(table.stats.failure_kinds),
        table.stats.closed,
        queues,
        table.deadlines.next_due,
        record.entered_at,
        record.finished_at,
        record.transfer_started_at,
        record.reason,
        record.pages_state,
        table.deadlines.draining(),
    )


HOOKS = {
    "enter_phase": (_status.enter_phase, KVPoll.WaitingForInput),
    "enter_transferring": (_status.enter_transferring, KVPoll.Transferring),
    "exit_phase": (_status.exit_phase, KVPoll.Bootstrapping),
    "enter_success": (_status.enter_success, KVPoll.Success),
    "record_failure": (_status.record_failure, KVPoll.Transferring),
    "enter_failed": (_status.enter_failed, KVPoll.Failed),
}


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_the_callable_does_what_its_inlined_lines_do(name: str) -> None:
    hook, state = HOOKS[name]
    reason = FailureReason(FailureKind.ABORTED, "x", KVPoll.Transferring)
    results = []
    for way in ("callable", "inlined"):
        table = StatusTable(Timeouts(bootstrap=1.0, waiting=2.0, transferring=3.0))
        record = _Record(table, 7, state)
        if name == "exit_phase":  # leaving a phase it had entered and armed
            table.live[state] += 1
            table.deadlines.arm(record, state, 0.0)
        if way == "callable":
            hook(record, 5.0, reason)
        else:
            _run_lines(inline_lines(hook, state, table), table, record, 5.0, reason)
        results.append(_snapshot(table, record))
    assert results[0] == results[1]


def test_a_hook_is_compiled_from_its_lines_only() -> None:
    hook = status_hook("mark", "Marks the room.", "room.entered_at = now", "live[{index}] += 2", ARM)
    assert hook.__doc__ == "Marks the room."
    assert hook.__kvfsm_inline__ == ("room.entered_at = now", "live[{index}] += 2", ARM)  # type: ignore[attr-defined]
    source: str = hook.__kvfsm_source__  # type: ignore[attr-defined]
    assert "live[room.state] += 2" in source and "table.deadlines.arm(room, room.state, now)" in source
    table = StatusTable(Timeouts(bootstrap=1.0))
    record = _Record(table, 1, KVPoll.Bootstrapping)
    hook(record, 3.0, None)
    assert record.entered_at == 3.0
    assert table.live[KVPoll.Bootstrapping] == 2
    assert table.deadlines.next_due == 4.0
    assert inline_lines(hook, KVPoll.Bootstrapping, table)[:2] == ["room.entered_at = now", "live[1] += 2"]
