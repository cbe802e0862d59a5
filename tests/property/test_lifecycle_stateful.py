"""A hypothesis state machine over many rooms, checked against an independent model.

The model below re-states DESIGN.md's table and rules in a few lines of
plain Python; hypothesis drives the real manager and the model with the same
random operations (open, every event, abort, close, stale handles, clock
ticks, drains) and the invariants compare them after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

import kvfsm
from kvfsm import FailureKind, FailureReason, KVPoll, Timeouts, TransferHandle, TransferManager
from tests.helpers import FakeClock

B, W, T, S, F = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success, KVPoll.Failed
MODEL_TABLE = {
    (B, "bootstrapped"): W,
    (W, "transfer_started"): T,
    (T, "chunk_done"): T,
    (T, "transfer_done"): S,
    **{(s, e): F for s in (B, W, T) for e in ("fail", "abort")},
}
TIMEOUTS = Timeouts(bootstrap=10.0, waiting=7.0, transferring=5.0, drain=3.0)
LIMITS = {B: 10.0, W: 7.0, T: 5.0}
ROOMS = st.integers(min_value=0, max_value=5)
EVENTS = st.sampled_from(["bootstrapped", "transfer_started", "chunk_done", "transfer_done", "fail", "abort"])


@dataclass
class ModelRoom:
    generation: int
    state: KVPoll = B
    entered: float = 0.0
    kind: FailureKind | None = None
    failed_at: float | None = None
    drained: bool = False
    history: list[KVPoll] = field(default_factory=list)


class LifecycleMachine(RuleBasedStateMachine):
    handles = Bundle("handles")
    engine = "compiled"

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.manager = TransferManager("receiver", timeouts=TIMEOUTS, clock=self.clock, engine=self.engine)
        self.model: dict[kvfsm.RoomId, ModelRoom] = {}
        self.closed_generations: set[int] = set()
        self.late = 0
        self.invalid = 0
        self.timeouts = 0

    # -- the model ------------------------------------------------------------------

    def _enter(self, room: ModelRoom, state: KVPoll, kind: FailureKind | None = None) -> None:
        room.history.append(state)
        room.state = state
        room.entered = self.clock.now
        if state is F:
            room.kind = kind
            room.failed_at = self.clock.now

    def _expire(self) -> set[kvfsm.RoomId]:
        expired = set()
        for room_id, room in self.model.items():
            limit = LIMITS.get(room.state)
            if limit is not None and self.clock.now >= room.entered + limit:
                self._enter(room, F, FailureKind.TIMEOUT)
                expired.add(room_id)
        self.timeouts += len(expired)
        return expired

    # -- rules ----------------------------------------------------------------------------

    @initialize(target=handles, room=ROOMS)
    def first_room(self, room: int) -> TransferHandle:
        return self._open(room)

    @precondition(lambda self: len(self.model) < 6)
    @rule(target=handles, room=ROOMS)
    def open_room(self, room: int) -> TransferHandle:
        return self._open(room)

    def _open(self, room: int) -> TransferHandle:
        self._expire()
        if room in self.model:
            with pytest.raises(kvfsm.DuplicateRoom):
                self.manager.open(room)
            return self.manager.get(room)
        handle = self.manager.open(room)
        assert handle.generation not in self.closed_generations
        self.model[room] = ModelRoom(handle.generation, entered=self.clock.now, history=[B])
        return handle

    @rule(handle=handles, event=EVENTS)
    def send_event(self, handle: TransferHandle, event: str) -> None:
        self._expire()
        if event == "chunk_done":
            applied = handle.chunk_done(4096)
        elif event == "fail":
            applied = handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, "injected"))
        elif event == "abort":
            applied = handle.abort("injected abort")
        else:
            applied = getattr(handle, event)()
        room = self.model.get(handle.room)
        if room is None or room.generation != handle.generation:
            assert not applied, "a stale handle changed something"
            self.late += 1
            return
        dest = MODEL_TABLE.get((room.state, event))
        if room.state in (S, F):
            assert not applied
            self.late += 1
        elif dest is None:
            assert not applied
            self.invalid += 1
            self._enter(room, F, FailureKind.INVALID_EVENT)
        else:
            assert applied
            if dest is not room.state:
                kind = {"fail": FailureKind.TRANSFER_ERROR, "abort": FailureKind.ABORTED}.get(event)
                self._enter(room, dest, kind)

    @rule(handle=handles)
    def drain(self, handle: TransferHandle) -> None:
        handle.writes_drained()
        room = self.model.get(handle.room)
        if room is not None and room.generation == handle.generation and room.state is F:
            room.drained = True

    @rule(handle=consumes(handles))
    def close(self, handle: TransferHandle) -> None:
        self._expire()
        room = self.model.get(handle.room)
        if room is None or room.generation != handle.generation:
            with pytest.raises(kvfsm.UnknownRoom):
                handle.close()
            return
        handle.close()
        if room.state not in (S, F):
            self._enter(room, F, FailureKind.ABORTED)
        del self.model[handle.room]
        self.closed_generations.add(handle.generation)
        with pytest.raises(kvfsm.UnknownRoom):
            self.manager.status(handle.room)

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0, 3.0, 5.0, 7.0]))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        expected = self._expire()
        assert set(self.manager.check_deadlines()) == expected

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def table_matches_handles_and_model(self) -> None:
        assert len(self.manager) == len(self.model)
        for room_id, room in self.model.items():
            handle = self.manager.get(room_id)
            assert handle.generation == room.generation
            assert handle.state is room.state
            assert self.manager._table.status[room_id] is room.state
            if room.state is F:
                assert handle.failure is not None and handle.failure.kind is room.kind
            else:
                assert handle.failure is None

    @invariant()
    def failed_and_success_absorb(self) -> None:
        for room in self.model.values():
            for earlier, later in zip(room.history, room.history[1:], strict=False):
                assert earlier not in (S, F), f"left terminal state {earlier.name}: {room.history}"
                assert later is not earlier

    @invariant()
    def counts_add_up(self) -> None:
        counts = self.manager.counts()
        assert sum(counts.values()) == len(self.model)
        for state in KVPoll:
            assert counts[state] == sum(1 for r in self.model.values() if r.state is state)
        stats = self.manager.stats
        assert stats.late_events == self.late
        assert stats.invalid_events == self.invalid
        assert stats.timeouts == self.timeouts

    @invariant()
    def release_gate_honoured(self) -> None:
        # Rule 6: a failed room's pages are released on proof only; past the drain deadline
        # without one they are quarantined (not release-safe), never freed on the timer.
        for room_id, room in self.model.items():
            expected = room.state is S or (room.state is F and room.drained)
            assert self.manager.release_safe(room_id) is expected
            if room.state is F and not room.drained:
                quarantined = room.failed_at is not None and self.clock.now >= room.failed_at + 3.0
                pages = kvfsm.PagesState.QUARANTINED if quarantined else kvfsm.PagesState.DRAINING
                assert self.manager.get(room_id).pages_state is pages


class TransitionsEngineMachine(LifecycleMachine):
    engine = "transitions"


TestLifecycleCompiled = LifecycleMachine.TestCase
TestLifecycleTransitions = TransitionsEngineMachine.TestCase
