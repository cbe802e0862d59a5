"""TransferManager and its handles: one test group per rule of DESIGN.md."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest

import kvfsm
from kvfsm import FailureKind, FailureReason, KVPoll, RoomId, StateChange, Timeouts, TransferManager
from tests.helpers import FakeClock
from tests.lifecycle import open_in


@pytest.fixture(params=["compiled", "transitions"])
def engine(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def full_lifecycle(manager: TransferManager, room: int) -> kvfsm.TransferHandle:
    handle = manager.open(room)
    assert handle.bootstrapped()
    assert handle.transfer_started()
    assert handle.chunk_done(100)
    assert handle.chunk_done(50, last=True)
    assert handle.transfer_done()
    return handle


# -- happy path and rule 1 (the table follows every transition) ----------------------


def test_happy_lifecycle_keeps_table_and_handle_in_step(engine: str, clock: FakeClock) -> None:
    manager = TransferManager("sender", engine=engine, clock=clock)
    handle = manager.open(5)
    seen = [manager.status(5)]
    for event in ("bootstrapped", "transfer_started"):
        clock.advance(1.0)
        getattr(handle, event)()
        seen.append(manager.status(5))
        assert manager.status(5) is handle.state
    clock.advance(1.0)
    handle.chunk_done(100)
    clock.advance(1.0)
    handle.chunk_done(28, last=True)
    clock.advance(1.0)
    handle.transfer_done()
    seen.append(manager.status(5))
    assert seen == [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]
    assert handle.is_terminal and handle.release_safe and manager.release_safe(5)
    assert (handle.nbytes, handle.chunks) == (128, 2)
    assert handle.transfer_latency == pytest.approx(2.0)  # first chunk start to last chunk done
    assert manager.counts() == {s: int(s is KVPoll.Success) for s in KVPoll}
    assert manager.stats.final_states[KVPoll.Success] == 1


def test_counts_track_every_state(engine: str) -> None:
    manager = TransferManager("receiver", engine=engine)
    for room, state in enumerate(KVPoll):
        open_in(manager, room, state)
    assert manager.counts() == {state: 1 for state in KVPoll}
    assert len(manager) == 5
    manager.close(0)
    assert sum(manager.counts().values()) == 4


# -- rule 2: terminal states absorb ------------------------------------------------------


def test_late_success_never_overwrites_failed(engine: str) -> None:
    manager = TransferManager("sender", engine=engine)
    handle = open_in(manager, 1, KVPoll.Transferring)
    assert handle.abort("client went away")
    assert handle.transfer_done() is False
    assert handle.chunk_done(10) is False
    assert handle.bootstrapped() is False
    assert manager.status(1) is KVPoll.Failed
    assert handle.failure is not None and handle.failure.kind is FailureKind.ABORTED
    assert manager.stats.late_events == 3


def test_fail_after_success_is_absorbed(engine: str) -> None:
    manager = TransferManager("sender", engine=engine)
    handle = full_lifecycle(manager, 1)
    assert handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, "too late")) is False
    assert manager.status(1) is KVPoll.Success and handle.failure is None
    assert manager.stats.late_events == 1


# -- rule 4: open, live, closed; tombstones and generations ----------------------------------


def test_duplicate_open_raises_and_leaves_room_alone() -> None:
    manager = TransferManager("receiver")
    handle = open_in(manager, 9, KVPoll.WaitingForInput)
    with pytest.raises(kvfsm.DuplicateRoom) as info:
        manager.open(9)
    assert info.value.room == 9 and info.value.state is KVPoll.WaitingForInput
    assert "room 9 is already open (generation 1, WaitingForInput)" in str(info.value)
    assert manager.get(9) is handle and handle.state is KVPoll.WaitingForInput
    assert manager.stats.opened == 1


def test_closed_room_is_unknown_and_never_recreated(engine: str) -> None:
    manager = TransferManager("sender", engine=engine)
    handle = full_lifecycle(manager, 3)
    manager.close(3)
    assert 3 not in manager
    with pytest.raises(
        kvfsm.UnknownRoom, match=r"room 3 is not open: it was closed \(generation 1, final state Success\)"
    ):
        manager.status(3)
    with pytest.raises(KeyError):
        manager.release_safe(3)
    # Late events through the closed handle are counted, never re-create it.
    assert handle.abort() is False
    assert handle.fail(FailureReason(FailureKind.PEER_LOST)) is False
    assert 3 not in manager and len(manager) == 0
    assert manager.stats.stale_events == 2 and manager.stats.late_events == 2
    assert manager.counts() == {state: 0 for state in KVPoll}


def test_never_opened_room_is_unknown() -> None:
    manager = TransferManager("receiver")
    with pytest.raises(kvfsm.UnknownRoom, match="never opened on this receiver manager"):
        manager.status(404)
    with pytest.raises(kvfsm.UnknownRoom):
        manager.close(404)
    with pytest.raises(kvfsm.UnknownRoom):
        manager.failure(404)


def test_stale_handle_cannot_touch_a_reopened_room(engine: str) -> None:
    manager = TransferManager("sender", engine=engine)
    old = full_lifecycle(manager, 11)
    manager.close(11)
    new = manager.open(11)
    assert new.generation > old.generation
    assert old.abort("stale abort") is False
    assert old.transfer_done() is False
    assert new.state is KVPoll.Bootstrapping and manager.status(11) is KVPoll.Bootstrapping
    with pytest.raises(kvfsm.UnknownRoom, match="open again as generation"):
        old.poll()
    with pytest.raises(kvfsm.UnknownRoom):
        old.close()
    assert manager.get(11) is new


def test_close_aborts_a_room_in_flight(engine: str) -> None:
    manager = TransferManager("receiver", engine=engine)
    changes: list[StateChange] = []
    manager.subscribe(changes.append)
    handle = open_in(manager, 2, KVPoll.Transferring)
    manager.close(2)
    assert handle.state is KVPoll.Failed and handle.closed
    assert [c.event for c in changes][-2:] == ["abort", "close"]
    assert changes[-2].reason is not None and "closed while Transferring" in changes[-2].reason.message


def test_double_close_is_unknown_room() -> None:
    manager = TransferManager("sender")
    handle = manager.open(1)
    handle.close()
    with pytest.raises(kvfsm.UnknownRoom, match="it was closed"):
        manager.close(1)


def test_tombstone_memory_is_bounded() -> None:
    manager = TransferManager("sender", remember_closed=2)
    for room in range(5):
        manager.open(room).close()
    with pytest.raises(kvfsm.UnknownRoom, match="it was closed"):
        manager.status(4)
    with pytest.raises(kvfsm.UnknownRoom, match=r"never opened .*or was closed long ago"):
        manager.status(0)


def test_closed_handles_are_garbage_collected() -> None:
    manager = TransferManager("sender")
    handle = full_lifecycle(manager, 1)
    ref = weakref.ref(handle)
    manager.close(1)
    del handle
    gc.collect()
    assert ref() is None


# -- rule 5: abort is synchronous and idempotent ----------------------------------------------


@pytest.mark.parametrize("state", [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring])
def test_abort_is_synchronous_from_every_live_state(engine: str, state: KVPoll) -> None:
    manager = TransferManager("receiver", engine=engine)
    handle = open_in(manager, 1, state)
    assert handle.abort("user cancelled") is True
    # Already visible to the scheduler when abort() returns.
    assert manager.status(1) is KVPoll.Failed
    reason = manager.failure(1)
    assert reason == FailureReason(FailureKind.ABORTED, "user cancelled", state, from_peer=False)
    assert handle.abort("again") is False  # idempotent
    assert manager.failure(1) == reason
    assert manager.stats.aborts == 1


def test_abort_on_success_is_a_no_op() -> None:
    manager = TransferManager("sender")
    handle = full_lifecycle(manager, 1)
    assert handle.abort() is False
    assert manager.status(1) is KVPoll.Success


# -- rule 6: release gate --------------------------------------------------------------------


def test_failed_room_is_release_safe_only_after_drain(clock: FakeClock, engine: str) -> None:
    manager = TransferManager("receiver", engine=engine, clock=clock, timeouts=Timeouts(drain=10.0))
    handle = open_in(manager, 1, KVPoll.Transferring)
    assert not manager.release_safe(1)
    handle.abort()
    assert not manager.release_safe(1)
    clock.advance(9.9)
    assert not manager.release_safe(1)
    handle.writes_drained()
    assert manager.release_safe(1)
    assert handle.release_safe
    assert handle.state is KVPoll.Failed  # draining is not a lifecycle event


def test_drain_deadline_quarantines_and_is_logged_once(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 24: on the starting code the deadline released the pages (release_safe turned True).
    manager = TransferManager("receiver", clock=clock, timeouts=Timeouts(drain=10.0))
    handle = open_in(manager, 1, KVPoll.Failed)
    handle.holds(4096)
    clock.advance(10.0)
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        assert not manager.release_safe(1)
        assert not manager.release_safe(1)
        manager.check_deadlines()
    warnings = [r for r in caplog.records if "drain deadline" in r.getMessage()]
    assert len(warnings) == 1 and "room 1" in warnings[0].getMessage() and "quarantined" in warnings[0].getMessage()
    assert handle.pages_state is kvfsm.PagesState.QUARANTINED
    assert (manager.stats.quarantined, manager.stats.quarantined_bytes, manager.stats.quarantines) == (1, 4096, 1)
    assert manager.stats.drain_deadline_releases == 0
    assert handle.state is KVPoll.Failed  # quarantine is not a lifecycle event either
    # A proof that comes late releases the pages, and the gauges drop.
    handle.writes_drained()
    assert manager.release_safe(1)
    assert (manager.stats.quarantined, manager.stats.quarantined_bytes, manager.stats.released_after_quarantine) == (
        0,
        0,
        1,
    )


def test_opt_in_timer_release_restores_the_old_behaviour(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    manager = TransferManager("receiver", clock=clock, timeouts=Timeouts(drain=10.0), on_drain_deadline="release")
    open_in(manager, 1, KVPoll.Failed)
    clock.advance(9.9)
    assert not manager.release_safe(1)
    clock.advance(0.1)
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        assert manager.release_safe(1)
        assert manager.release_safe(1)
    warnings = [r for r in caplog.records if "drain deadline" in r.getMessage()]
    assert len(warnings) == 1 and "may still land" in warnings[0].getMessage()
    assert manager.stats.drain_deadline_releases == 1
    assert manager.stats.quarantines == 0


def test_no_drain_deadline_means_wait_for_drain(clock: FakeClock) -> None:
    manager = TransferManager("receiver", clock=clock, timeouts=Timeouts(drain=None))
    handle = open_in(manager, 1, KVPoll.Failed)
    clock.advance(1e6)
    assert not manager.release_safe(1)
    handle.writes_drained()
    assert manager.release_safe(1)


@pytest.mark.parametrize("state", [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success])
def test_writes_drained_does_not_change_state_or_open_the_gate_early(state: KVPoll) -> None:
    manager = TransferManager("receiver")
    handle = open_in(manager, 1, state)
    handle.writes_drained()
    assert handle.state is state and manager.status(1) is state
    if state is not KVPoll.Success:
        handle.abort()
        # A drain reported before the failure says nothing about writes after it.
        assert not manager.release_safe(1)


# -- rule 7: deadlines --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "limit"),
    [(KVPoll.Bootstrapping, "bootstrap"), (KVPoll.WaitingForInput, "waiting"), (KVPoll.Transferring, "transferring")],
)
def test_each_phase_times_out_on_status_read(clock: FakeClock, engine: str, state: KVPoll, limit: str) -> None:
    timeouts = Timeouts(bootstrap=10.0, waiting=20.0, transferring=30.0)
    manager = TransferManager("receiver", engine=engine, clock=clock, timeouts=timeouts)
    handle = open_in(manager, 1, state)
    seconds = getattr(timeouts, limit)
    clock.advance(seconds - 0.001)
    assert manager.status(1) is state
    clock.advance(0.001)
    assert manager.status(1) is KVPoll.Failed
    reason = handle.failure
    assert reason is not None and reason.kind is FailureKind.TIMEOUT and reason.state is state
    assert f"{limit} deadline of {seconds:g}s passed" in reason.message
    assert manager.stats.timeouts == 1


def test_deadline_restarts_on_each_state_entry(clock: FakeClock) -> None:
    manager = TransferManager("sender", clock=clock, timeouts=Timeouts(bootstrap=10.0, waiting=10.0))
    handle = manager.open(1)
    clock.advance(9.0)
    handle.bootstrapped()
    clock.advance(9.0)
    assert manager.status(1) is KVPoll.WaitingForInput
    clock.advance(1.0)
    assert manager.status(1) is KVPoll.Failed


def test_deadline_enforced_before_an_event_applies(clock: FakeClock) -> None:
    manager = TransferManager("sender", clock=clock, timeouts=Timeouts(waiting=5.0))
    handle = open_in(manager, 1, KVPoll.WaitingForInput)
    clock.advance(6.0)
    # The deadline passed before transfer_started arrived: the event is late.
    assert handle.transfer_started() is False
    assert handle.state is KVPoll.Failed
    assert handle.failure is not None and handle.failure.kind is FailureKind.TIMEOUT


def test_none_timeout_never_expires(clock: FakeClock) -> None:
    manager = TransferManager("sender", clock=clock, timeouts=Timeouts(bootstrap=None, waiting=None))
    open_in(manager, 1, KVPoll.WaitingForInput)
    clock.advance(1e9)
    assert manager.check_deadlines() == []
    assert manager.status(1) is KVPoll.WaitingForInput


def test_check_deadlines_returns_expired_rooms_in_order(clock: FakeClock) -> None:
    manager = TransferManager("receiver", clock=clock, timeouts=Timeouts(bootstrap=10.0))
    for room in range(3):
        manager.open(room)
        clock.advance(1.0)
    manager.get(1).bootstrapped()  # leaves the bootstrap phase: no deadline any more there
    clock.advance(8.5)  # room 0 due at 10, room 2 due at 12
    assert manager.check_deadlines() == [0]
    clock.advance(10.0)
    assert manager.check_deadlines() == [2]
    assert manager.get(1).state is KVPoll.WaitingForInput


def test_handle_poll_enforces_deadlines(clock: FakeClock) -> None:
    manager = TransferManager("sender", clock=clock, timeouts=Timeouts(bootstrap=1.0))
    handle = manager.open(1)
    clock.advance(2.0)
    assert handle.state is KVPoll.Bootstrapping  # plain read: no enforcement
    assert handle.poll() is KVPoll.Failed


def test_reaper_fails_rooms_nobody_polls() -> None:
    clock = FakeClock()
    manager = TransferManager("receiver", clock=clock, timeouts=Timeouts(bootstrap=5.0))
    expired = threading.Event()
    manager.subscribe(lambda change: expired.set() if change.event == "timeout" else None)
    handle = manager.open(1)
    with manager:
        manager.start_reaper(interval=0.005)
        manager.start_reaper(interval=0.005)  # idempotent
        assert manager.reaper_running is True
        clock.advance(5.0)
        assert expired.wait(10.0), "the reaper never enforced the deadline"
    running_after_exit: bool = manager.reaper_running
    assert not running_after_exit
    assert handle.state is KVPoll.Failed


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "1"])
def test_bad_reaper_interval(bad: object) -> None:
    with pytest.raises(kvfsm.ConfigError, match="reaper interval must be a positive number"):
        TransferManager("sender").start_reaper(bad)  # type: ignore[arg-type]


def test_timeout_is_logged_with_room(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    manager = TransferManager("sender", clock=clock, timeouts=Timeouts(bootstrap=1.0))
    manager.open("req-7")
    clock.advance(1.0)
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        manager.check_deadlines()
    assert any("room 'req-7' timed out" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# -- rule 8: structured failures -----------------------------------------------------------------


def test_fail_records_structured_reason_with_state() -> None:
    manager = TransferManager("receiver")
    handle = open_in(manager, 1, KVPoll.WaitingForInput)
    handle.fail(FailureReason(FailureKind.PEER_LOST, "heartbeat lost", from_peer=True))
    assert manager.failure(1) == FailureReason(FailureKind.PEER_LOST, "heartbeat lost", KVPoll.WaitingForInput, True)
    with pytest.raises(kvfsm.KVTransferError) as info:
        handle.failure_exception()
    assert info.value.room == 1 and info.value.reason == manager.failure(1)
    assert manager.stats.failure_kinds[FailureKind.PEER_LOST] == 1


def test_failure_exception_on_live_room_is_an_error() -> None:
    handle = TransferManager("receiver").open(1)
    with pytest.raises(kvfsm.RoomNotFailed, match="room 1 has not failed"):
        handle.failure_exception()


def test_reasons_are_dropped_on_close() -> None:
    manager = TransferManager("receiver")
    handle = open_in(manager, 1, KVPoll.Failed)
    assert handle.failure is not None
    manager.close(1)
    assert handle.failure is None


# -- rule 10: observers ---------------------------------------------------------------------------


def test_observers_see_every_step_in_order(engine: str, clock: FakeClock) -> None:
    manager = TransferManager("sender", engine=engine, clock=clock)
    changes: list[StateChange] = []
    unsubscribe = manager.subscribe(changes.append)
    full_lifecycle(manager, 4)
    manager.close(4)
    assert [(c.event, c.source, c.dest) for c in changes] == [
        ("open", None, KVPoll.Bootstrapping),
        ("bootstrapped", KVPoll.Bootstrapping, KVPoll.WaitingForInput),
        ("transfer_started", KVPoll.WaitingForInput, KVPoll.Transferring),
        ("chunk_done", KVPoll.Transferring, KVPoll.Transferring),
        ("chunk_done", KVPoll.Transferring, KVPoll.Transferring),
        ("transfer_done", KVPoll.Transferring, KVPoll.Success),
        ("close", KVPoll.Success, None),
    ]
    assert [(c.nbytes, c.last) for c in changes if c.event == "chunk_done"] == [(100, False), (50, True)]
    assert all(c.room == 4 and c.role is kvfsm.Role.SENDER and c.time == clock.now for c in changes)
    unsubscribe()
    manager.open(5)
    assert len(changes) == 7


def test_observer_errors_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    manager = TransferManager("sender")

    def broken(change: StateChange) -> None:
        raise RuntimeError("observer bug")

    manager.subscribe(broken)
    with caplog.at_level(logging.ERROR, logger="kvfsm"):
        handle = manager.open(1)
        assert handle.abort()
    assert handle.state is KVPoll.Failed
    assert any("observer" in r.getMessage() and "room 1" in r.getMessage() for r in caplog.records)


def test_observer_runs_without_the_lock_and_may_call_back() -> None:
    manager = TransferManager("sender")
    closed: list[int] = []

    def close_on_failure(change: StateChange) -> None:
        # Re-entering the manager from an observer must not deadlock.
        if change.dest is KVPoll.Failed:
            manager.close(change.room)
            closed.append(change.room)  # type: ignore[arg-type]

    manager.subscribe(close_on_failure)
    manager.open(1).abort()
    assert closed == [1] and 1 not in manager


# -- logging ---------------------------------------------------------------------------------------


def test_failures_and_invalid_events_are_logged_with_room(caplog: pytest.LogCaptureFixture) -> None:
    manager = TransferManager("receiver")
    with caplog.at_level(logging.DEBUG, logger="kvfsm"):
        manager.open(1).abort("bye")
        manager.open(2).transfer_done()
        manager.get(1).transfer_done()
    by_level = {(r.levelno, r.getMessage()) for r in caplog.records}
    assert any(level == logging.INFO and "room 1 aborted" in msg for level, msg in by_level)
    assert any(
        level == logging.WARNING and "room 2: out-of-order event 'transfer_done'" in msg for level, msg in by_level
    )
    assert any(
        level == logging.DEBUG and "room 1" in msg and "late event 'transfer_done'" in msg for level, msg in by_level
    )


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("room", [None, 1.5, True, (1, 2), b"x"])
def test_bad_room_ids_are_type_errors(room: object) -> None:
    manager = TransferManager("sender")
    with pytest.raises(TypeError, match=r"room must be an int in .* or a str of 1 to 1024 characters"):
        manager.open(room)  # type: ignore[arg-type]
    assert len(manager) == 0


@pytest.mark.parametrize("method", ["open", "status", "get", "failure", "release_safe", "close"])
@pytest.mark.parametrize("room", [True, 1.0, None, "", "r" * (kvfsm.MAX_ROOM_ID_CHARS + 1), 1 << 64, -(1 << 63) - 1])
def test_room_ids_are_validated_identically_on_every_method(method: str, room: object) -> None:
    """`True` and `1.0` hash like room 1: a lookup alone would answer for room 1 (issue 11, defect 11)."""
    manager = TransferManager("sender")
    one = manager.open(1)
    with pytest.raises(kvfsm.InvalidRoomId, match="room must be an int in") as caught:
        getattr(manager, method)(room)
    assert isinstance(caught.value, (TypeError, ValueError))
    assert room not in manager
    assert manager.status(1) is KVPoll.Bootstrapping and one.state is KVPoll.Bootstrapping and len(manager) == 1


@pytest.mark.parametrize("room", [0, 1 << 63, (1 << 64) - 1, -(1 << 63), "r", "r" * kvfsm.MAX_ROOM_ID_CHARS])
def test_room_ids_at_the_limits_are_accepted(room: RoomId) -> None:
    manager = TransferManager("sender")
    handle = manager.open(room)
    assert manager.status(room) is KVPoll.Bootstrapping and manager.get(room) is handle
    manager.close(room)


def test_a_long_reason_is_cut_with_a_marker_saying_how_much() -> None:
    manager = TransferManager("sender")
    handle = manager.open(1)
    handle.abort("x" * 100_000)
    message = handle.reason.message if handle.reason else ""
    assert len(message) == kvfsm.MAX_REASON_CHARS
    kept, _, marker = message.partition(" [... ")
    assert kept == "x" * len(kept) and marker == f"{100_000 - len(kept)} more characters cut]"
    assert FailureReason(FailureKind.ABORTED, "short").message == "short"


def test_bad_event_arguments_leave_every_room_untouched() -> None:
    manager = TransferManager("sender")
    other = open_in(manager, 2, KVPoll.Transferring)
    handle = open_in(manager, 1, KVPoll.Transferring)
    with pytest.raises(ValueError, match=r"chunk_done\(nbytes\) of room 1 must be >= 0; got -5"):
        handle.chunk_done(-5)
    with pytest.raises(TypeError, match=r"chunk_done\(nbytes\) of room 1 must be an int"):
        handle.chunk_done(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fail\(\) of room 1 needs a kvfsm.FailureReason; got str"):
        handle.fail("boom")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"abort\(\) of room 1 takes a str reason"):
        handle.abort(42)  # type: ignore[arg-type]
    assert handle.state is KVPoll.Transferring and other.state is KVPoll.Transferring
    assert handle.nbytes == 0
    assert manager.stats.invalid_events == 0 and manager.stats.late_events == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"timeouts": 30}, TypeError, "timeouts must be a kvfsm.Timeouts"),
        ({"clock": 5}, TypeError, "clock must be a callable"),
        ({"strict": "yes"}, TypeError, "strict must be a bool"),
        ({"engine": "fast"}, kvfsm.ConfigError, "engine must be one of"),
        ({"remember_closed": -1}, kvfsm.ConfigError, "remember_closed must be an int >= 0"),
    ],
)
def test_bad_manager_configuration(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        TransferManager("sender", **kwargs)  # type: ignore[arg-type]


def test_subscribe_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="observer must be callable"):
        TransferManager("sender").subscribe(42)  # type: ignore[arg-type]


def test_an_observer_may_watch_only_some_events() -> None:
    """A backend watches failures and closes only; the other steps build no notice for it."""
    manager = TransferManager("receiver")
    seen: list[str] = []
    everything: list[str] = []
    manager.subscribe(lambda change: seen.append(change.event), events=("fail", "timeout", "abort", "close"))
    handle = open_in(manager, 1, KVPoll.Transferring)
    handle.chunk_done(8, last=True)
    handle.transfer_done()
    manager.close(1)
    other = manager.open(2)
    unsubscribe = manager.subscribe(lambda change: everything.append(change.event))
    other.abort("gone")
    unsubscribe()
    manager.close(2)
    assert seen == ["close", "abort", "close"]
    assert everything == ["abort"]
    with pytest.raises(kvfsm.ConfigError, match=r"subscribe\(events=\.\.\.\) takes .*; got frob"):
        manager.subscribe(lambda change: None, events=("frob",))


def test_a_filtered_observer_leaves_the_fast_path_in_place() -> None:
    manager = TransferManager("receiver")
    manager.subscribe(lambda change: None, events=("abort", "close"))
    assert manager._watching["open"] is False and manager._watching["bootstrapped"] is False
    assert manager._watching["abort"] is True and manager._watching["close"] is True
