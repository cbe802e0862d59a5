"""`LifecycleConformance`: the rules against a bare `TransferManager`, no adapter.

A manager subclass or another engine is checked with it too: it drives
rooms through random events, aborts, closes, reopenings and clock jumps,
and compares every step with the exact model of the declared table
(`strategies.expected_state`).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .._errors import DuplicateRoom, InvalidTransition, UnknownRoom
from .._manager import TransferHandle, TransferManager
from .._states import TERMINAL, FailureKind, KVPoll, Role, Timeouts
from ._checks import RoomLedger, check_agreement, check_deadlines, check_failure, raised_by
from .strategies import Event, ManualClock, events, expected_state, room_ids

__all__ = ["LifecycleConformance"]


class LifecycleConformance(RuleBasedStateMachine):
    """The rules of DESIGN.md against a bare `TransferManager`, with an exact table model.

    Override `make_manager` to check a subclass or another engine; set
    `strict = True` to check strict mode; `role` and `timeouts_under_test`
    are class attributes.
    """

    role: ClassVar[Role] = Role.RECEIVER
    strict: ClassVar[bool] = False
    timeouts_under_test: ClassVar[Timeouts] = Timeouts(bootstrap=30.0, waiting=60.0, transferring=90.0, drain=20.0)

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.manager = self.make_manager(self.clock)
        self.ledger = RoomLedger()
        self.live: dict[Hashable, TransferHandle] = {}
        self.closed_handles: list[TransferHandle] = []
        self.drained: set[int] = set()
        self._ids = itertools.count()

    def make_manager(self, clock: ManualClock) -> TransferManager:
        return TransferManager(self.role, timeouts=self.timeouts_under_test, clock=clock, strict=self.strict)

    # rules

    @rule(room=st.one_of(room_ids(), st.integers(0, 3)))
    def open_room(self, room: int | str) -> None:
        if room in self.live:
            raised = raised_by(lambda: self.manager.open(room))
            assert isinstance(raised, DuplicateRoom), f"rule 4 broken: opening live room {room!r} gave {raised!r}"
            assert self.manager.get(room) is self.live[room]
            return
        handle = self.manager.open(room)
        assert handle.state is KVPoll.Bootstrapping
        assert self.manager.status(room) is KVPoll.Bootstrapping
        self.live[room] = handle

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), event=events())
    def fire(self, data: st.DataObject, event: Event) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self._enforce_deadlines()
        before = handle.state
        expected = expected_state(before, event.name, strict=self.strict)
        if expected is None:
            raised = raised_by(lambda: event.apply(handle))
            assert isinstance(raised, InvalidTransition), f"strict mode: {event.name} in {before.name} gave {raised!r}"
            assert (raised.state, raised.event) == (before, event.name)
            assert handle.state is before, "strict mode must change nothing"
            return
        changed = event.apply(handle)
        assert handle.state is expected, (
            f"{event.name} in {before.name}: expected {expected.name}, got {handle.state.name}"
        )
        if before in TERMINAL:
            assert not changed, "an event on a terminal room reported a change"
        if event.name == "abort" and before not in TERMINAL:
            reason = handle.reason
            assert reason is not None
            assert reason.kind is FailureKind.ABORTED, "rule 5: abort must record an ABORTED reason synchronously"
            assert self.manager.status(handle.room) is KVPoll.Failed
        if event.name == "fail" and before not in TERMINAL and event.reason is not None:
            reason = handle.reason
            assert reason is not None
            assert (reason.kind, reason.message, reason.state) == (event.reason.kind, event.reason.message, before)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def writes_drained(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self._enforce_deadlines()
        before = handle.state
        handle.writes_drained()
        assert handle.state is before, "rule 6: writes_drained() must never change a state"
        if before is KVPoll.Failed:
            self.drained.add(id(handle))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self.manager.close(handle.room)
        assert handle.closed
        assert handle.state in TERMINAL
        del self.live[handle.room]
        self.closed_handles.append(handle)
        try:
            self.manager.status(handle.room)
        except UnknownRoom:
            pass
        else:
            raise AssertionError(f"rule 4 broken: closed room {handle.room!r} still has a status")

    @precondition(lambda self: bool(self.closed_handles))
    @rule(data=st.data(), event=events())
    def stale_event(self, data: st.DataObject, event: Event) -> None:
        handle = data.draw(st.sampled_from(self.closed_handles), label="closed room")
        successor = self.live.get(handle.room)
        successor_state = successor.state if successor is not None else None
        late = self.manager.stats.late_events
        assert not event.apply(handle), "an event on a closed generation reported a change"
        assert self.manager.stats.late_events == late + 1, "a stale event must be counted as late"
        if successor is not None:
            assert successor.state is successor_state, "rule 4 broken: a stale event reached the reopened room"

    @rule(seconds=st.floats(min_value=0.0, max_value=120.0, allow_nan=False))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # invariants

    @invariant()
    def status_table_agrees(self) -> None:
        check_agreement(self.manager, list(self.live.values()))
        counts = self.manager.counts()
        for state in KVPoll:
            expected = sum(1 for handle in self.live.values() if handle.state is state)
            assert counts[state] == expected, f"counts()[{state.name}] is {counts[state]}, expected {expected}"

    @invariant()
    def terminal_states_absorb(self) -> None:
        for handle in [*self.live.values(), *self.closed_handles]:
            self.ledger.observe(handle)

    @invariant()
    def failures_are_structured(self) -> None:
        for handle in self.live.values():
            check_failure(handle)

    @invariant()
    def release_gate(self) -> None:
        drain = self.manager.timeouts.drain
        for handle in self.live.values():
            state = handle.state
            if state is KVPoll.Success:
                expected = True
            elif state is KVPoll.Failed:
                assert handle.finished_at is not None
                past_deadline = drain is not None and self.clock() >= handle.finished_at + drain
                expected = id(handle) in self.drained or past_deadline
            else:
                expected = False
            assert handle.release_safe is expected, (
                f"rule 6 broken: room {handle.room!r} is {state.name} (drained: {id(handle) in self.drained}) "
                f"and release_safe is {handle.release_safe}"
            )

    @invariant()
    def deadlines_enforced(self) -> None:
        check_deadlines(self.manager, self.clock, list(self.live.values()))

    def _enforce_deadlines(self) -> None:
        # Events enforce due deadlines before they apply; the model does the same.
        self.manager.check_deadlines()

    def teardown(self) -> None:
        self.manager.stop_reaper()
