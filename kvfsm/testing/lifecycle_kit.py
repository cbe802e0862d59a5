"""`LifecycleConformance`: the rules against a bare `TransferManager`, no adapter, for any lifecycle.

A manager subclass, another engine or another declared lifecycle is
checked with it: it drives rooms through random events, aborts, closes,
reopenings, proofs and clock jumps, and compares every step with the exact
model of the declared lifecycle (`strategies.expected_state`) and every
release answer with the model of the release phase (`_release.py`): a
failed room's pages are released on proof only, quarantined when the
drain deadline passes without one, and released again by a late proof or
an operator's override.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .._errors import DuplicateRoom, InvalidTransition, NotQuarantined, UnknownRoom
from .._lifecycle import KV_LIFECYCLE, Lifecycle, PhaseTimeouts, Timeouts
from .._manager import TransferHandle, TransferManager
from .._release import PagesState
from .._states import FailureKind, KVPoll, Role
from ._checks import RoomLedger, check_agreement, check_deadlines, check_failure, raised_by
from .strategies import ManualClock, events, expected_state, room_ids

__all__ = ["LifecycleConformance"]


class LifecycleConformance(RuleBasedStateMachine):
    """The rules of DESIGN.md against a bare `TransferManager`, with an exact model of its lifecycle.

    Override `make_manager` to check a subclass or another engine; set
    `lifecycle` to check another declared lifecycle; `strict = True` to
    check strict mode; `on_drain_deadline = "release"` to check the opt-in
    timer release. `role` and `timeouts_under_test` are class attributes
    too (None: 30 s, 60 s, 90 s, ... per phase of the lifecycle, drain 20 s).
    """

    role: ClassVar[Role] = Role.RECEIVER
    strict: ClassVar[bool] = False
    lifecycle: ClassVar[Lifecycle] = KV_LIFECYCLE
    on_drain_deadline: ClassVar[str] = "quarantine"
    timeouts_under_test: ClassVar[PhaseTimeouts | None] = Timeouts(
        bootstrap=30.0, waiting=60.0, transferring=90.0, drain=20.0
    )

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.manager = self.make_manager(self.clock)
        self.ledger = RoomLedger()
        self.live: dict[Hashable, TransferHandle] = {}
        self.closed_handles: list[TransferHandle] = []
        # Failed rooms (by handle id) a proof or an override released.
        self.released: set[int] = set()
        self._ids = itertools.count()

    @classmethod
    def timeouts_for_lifecycle(cls) -> PhaseTimeouts:
        timeouts = cls.timeouts_under_test
        if timeouts is not None and isinstance(timeouts, cls.lifecycle.Timeouts):
            return timeouts
        phases = {phase: 30.0 * (i + 1) for i, phase in enumerate(cls.lifecycle.phases)}
        return cls.lifecycle.Timeouts(**phases, drain=20.0)

    def make_manager(self, clock: ManualClock) -> TransferManager:
        return TransferManager(
            self.role,
            lifecycle=self.lifecycle,
            timeouts=self.timeouts_for_lifecycle(),
            clock=clock,
            strict=self.strict,
            on_drain_deadline=self.on_drain_deadline,
        )

    # rules

    @rule(room=st.one_of(room_ids(), st.integers(0, 3)))
    def open_room(self, room: int | str) -> None:
        if room in self.live:
            raised = raised_by(lambda: self.manager.open(room))
            assert isinstance(raised, DuplicateRoom), f"rule 4 broken: opening live room {room!r} gave {raised!r}"
            assert self.manager.get(room) is self.live[room]
            return
        handle = self.manager.open(room)
        initial = self.lifecycle.initial
        assert handle.state is initial
        assert self.manager.status(room) is self.lifecycle.reports[initial]
        assert handle.pages_state is PagesState.HELD and not handle.release_safe
        self.live[room] = handle

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fire(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        event = data.draw(events(lifecycle=self.lifecycle), label="event")
        self._enforce_deadlines()
        before = handle.state
        terminal = before in self.lifecycle.terminal
        expected = expected_state(before, event.name, strict=self.strict, lifecycle=self.lifecycle)
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
        if terminal:
            assert not changed, "an event on a terminal room reported a change"
        if event.name == "abort" and not terminal:
            reason = handle.reason
            assert reason is not None
            assert reason.kind is FailureKind.ABORTED, "rule 5: abort must record an ABORTED reason synchronously"
            assert self.manager.status(handle.room) is KVPoll.Failed
        if event.name == "fail" and not terminal and event.reason is not None:
            reason = handle.reason
            assert reason is not None
            assert (reason.kind, reason.message, reason.state) == (event.reason.kind, event.reason.message, before)

    @precondition(lambda self: bool(self.live) or bool(self.closed_handles))
    @rule(data=st.data(), proof=st.sampled_from(["drained", "fenced"]))
    def prove(self, data: st.DataObject, proof: str) -> None:
        """A proof arrives: for an open room, or for a closed one whose pages may still be held."""
        pool = sorted(self.live.values(), key=repr) + self.closed_handles
        handle = data.draw(st.sampled_from(pool), label="room")
        self._enforce_deadlines()
        before = handle.state
        pages = handle.pages_state
        if proof == "drained":
            handle.writes_drained()
        else:
            handle.fenced("the kit says the peer is gone")
        assert handle.state is before, "rule 6: a proof must never change a state"
        if pages in (PagesState.DRAINING, PagesState.QUARANTINED):
            assert handle.pages_state is PagesState.RELEASED, f"a proof left pages {handle.pages_state.value}"
            self.released.add(id(handle))
        else:
            assert handle.pages_state is pages, "a proof moved pages that were not waiting for one"

    @precondition(lambda self: bool(self.manager.stats.quarantined))
    @rule(data=st.data())
    def override(self, data: st.DataObject) -> None:
        quarantined = self.manager.quarantined()
        assert len(quarantined) == self.manager.stats.quarantined
        handle = data.draw(st.sampled_from(quarantined), label="quarantined room")
        overrides = self.manager.stats.quarantine_overrides
        released = self.manager.release_quarantined(handle.room, "the kit's operator")
        assert released >= 1 and handle.pages_state is PagesState.RELEASED
        assert self.manager.stats.quarantine_overrides == overrides + released
        self.released.add(id(handle))
        for other in [*self.live.values(), *self.closed_handles]:
            if other.room == handle.room and other.pages_state is PagesState.RELEASED:
                self.released.add(id(other))
        raised = raised_by(lambda: self.manager.release_quarantined(handle.room, "again"))
        if not any(
            h.pages_state is PagesState.QUARANTINED for h in self.manager.quarantined() if h.room == handle.room
        ):
            assert isinstance(raised, NotQuarantined), f"a second override of {handle.room!r} gave {raised!r}"

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self.manager.close(handle.room)
        assert handle.closed
        assert handle.state in self.lifecycle.terminal
        del self.live[handle.room]
        self.closed_handles.append(handle)
        try:
            self.manager.status(handle.room)
        except UnknownRoom:
            pass
        else:
            raise AssertionError(f"rule 4 broken: closed room {handle.room!r} still has a status")
        if not handle.release_safe:
            assert self.manager.holds_pages(handle.room), "a closed room's unreleased pages were forgotten"

    @precondition(lambda self: bool(self.closed_handles))
    @rule(data=st.data())
    def stale_event(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.closed_handles), label="closed room")
        event = data.draw(events(lifecycle=self.lifecycle), label="event")
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
        reports = self.lifecycle.reports
        for value in KVPoll:
            expected = sum(1 for handle in self.live.values() if reports[handle.state] is value)
            assert counts[value] == expected, f"counts()[{value.name}] is {counts[value]}, expected {expected}"
        by_state = self.manager.state_counts()
        for state in self.lifecycle.State:
            expected = sum(1 for handle in self.live.values() if handle.state is state)
            assert by_state[state] == expected, (
                f"state_counts()[{state.name}] is {by_state[state]}, expected {expected}"
            )

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
        """Rule 6: pages are released on success or proof; without proof by the drain deadline, quarantined."""
        self.manager.check_deadlines()
        drain = self.manager.timeouts.drain
        timer = self.on_drain_deadline == "release"
        quarantined = 0
        for handle in [*self.live.values(), *self.closed_handles]:
            state = handle.state
            if state in self.lifecycle.successes:
                expected, pages = True, PagesState.RELEASED
            elif state is self.lifecycle.failure:
                assert handle.finished_at is not None
                past_deadline = drain is not None and self.clock() >= handle.finished_at + drain
                if id(handle) in self.released:
                    expected, pages = True, PagesState.RELEASED
                elif past_deadline:
                    expected = timer
                    pages = PagesState.RELEASED if timer else PagesState.QUARANTINED
                else:
                    expected, pages = False, PagesState.DRAINING
            else:
                expected, pages = False, PagesState.HELD
            assert handle.pages_state is pages, (
                f"release phase: room {handle.room!r} is {state.name}: expected pages {pages.value}, "
                f"got {handle.pages_state.value}"
            )
            assert handle.release_safe is expected, (
                f"rule 6 broken: room {handle.room!r} is {state.name} (pages {handle.pages_state.value}) "
                f"and release_safe is {handle.release_safe}"
            )
            quarantined += pages is PagesState.QUARANTINED
        assert self.manager.stats.quarantined == quarantined, (
            f"stats.quarantined is {self.manager.stats.quarantined}, the kit counts {quarantined}"
        )

    @invariant()
    def deadlines_enforced(self) -> None:
        check_deadlines(self.manager, self.clock, list(self.live.values()))

    def _enforce_deadlines(self) -> None:
        # Events enforce due deadlines before they apply; the model does the same.
        self.manager.check_deadlines()

    def teardown(self) -> None:
        self.manager.stop_reaper()
