"""`TransferManager.poll_many`: the scheduler's batch read, with `status()`'s semantics."""

from __future__ import annotations

import pytest

from kvfsm import FailureKind, KVPoll, Timeouts, TransferManager, UnknownRoom

from ..helpers import FakeClock


def test_states_come_back_in_the_order_asked() -> None:
    manager = TransferManager("receiver")
    rooms = [manager.open(room) for room in (5, "b", 3, 9)]
    rooms[1].bootstrapped()
    rooms[2].bootstrapped()
    rooms[2].transfer_started()
    rooms[3].abort("gone")
    order: list[int | str] = [9, 3, "b", 5, 3]
    assert manager.poll_many(order) == [manager.status(room) for room in order]
    assert manager.poll_many(order) == [
        KVPoll.Failed,
        KVPoll.Transferring,
        KVPoll.WaitingForInput,
        KVPoll.Bootstrapping,
        KVPoll.Transferring,
    ]
    assert manager.poll_many([]) == []
    assert manager.poll_many(iter([5])) == [KVPoll.Bootstrapping]  # any iterable


def test_due_deadlines_are_enforced_before_reading_and_the_clock_is_read_once() -> None:
    clock = FakeClock()
    reads = [0]

    def counting_clock() -> float:
        reads[0] += 1
        return clock()

    manager = TransferManager("sender", timeouts=Timeouts(bootstrap=1.0, waiting=10.0), clock=counting_clock)
    early, late = manager.open(1), manager.open(2)
    clock.advance(0.5)
    late.bootstrapped()
    clock.advance(0.6)  # room 1's bootstrap deadline passed; room 2 waits
    reads[0] = 0
    # Nothing has enforced the deadline yet: no reaper, nobody polled.
    assert early.state is KVPoll.Bootstrapping
    assert manager.poll_many([2, 1]) == [KVPoll.WaitingForInput, KVPoll.Failed]
    assert early.reason is not None and early.reason.kind is FailureKind.TIMEOUT
    reads[0] = 0
    assert manager.poll_many(range(1, 3)) == [KVPoll.Failed, KVPoll.WaitingForInput]
    assert reads[0] == 1  # one clock read for the whole batch (no deadline due any more)


def test_a_room_that_is_not_open_raises_unknown_room_naming_it() -> None:
    manager = TransferManager("sender")
    handle = manager.open(1)
    manager.open(2)
    handle.abort()
    manager.close(1)
    with pytest.raises(UnknownRoom, match="room 1 is not open: it was closed"):
        manager.poll_many([2, 1])
    with pytest.raises(UnknownRoom, match="room 7 is not open: it was never opened"):
        manager.poll_many([7])
