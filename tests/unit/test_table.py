"""The whole table, exhaustively: every (state, event) pair, both engines, both modes.

The expected outcomes are written out here from DESIGN.md's event table, not
derived from the code, so a change to the declaration that breaks the
contract fails this test.
"""

from __future__ import annotations

import itertools

import pytest

import kvfsm
from kvfsm import EVENTS, FailureKind, KVPoll, TransferManager
from tests.lifecycle import fire, open_in

B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)
NON_TERMINAL = (B, W, T)

#: (state, event) -> next state, for every pair DESIGN.md allows.
ALLOWED: dict[tuple[KVPoll, str], KVPoll] = {
    (B, "bootstrapped"): W,
    (W, "transfer_started"): T,
    (T, "chunk_done"): T,
    (T, "transfer_done"): S,
    **{(s, "fail"): F for s in NON_TERMINAL},
    **{(s, "abort"): F for s in NON_TERMINAL},
    **{(s, "timeout"): F for s in NON_TERMINAL},
}
# `timeout` is raised by the deadline machinery, not by a handle method.
HANDLE_EVENTS = [e for e in EVENTS if e != "timeout"]
ENGINES = ["compiled", "transitions"]


def test_declared_events_are_the_designed_ones() -> None:
    assert set(EVENTS) == {
        "bootstrapped",
        "transfer_started",
        "chunk_done",
        "transfer_done",
        "fail",
        "timeout",
        "abort",
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_allowed_events_match_design(engine: str) -> None:
    manager = TransferManager("sender", engine=engine)
    for state in KVPoll:
        expected = {event for (s, event) in ALLOWED if s is state}
        assert set(manager.allowed_events(state)) == expected, state


@pytest.mark.parametrize(("engine", "state", "event"), list(itertools.product(ENGINES, KVPoll, HANDLE_EVENTS)))
def test_every_state_event_pair(engine: str, state: KVPoll, event: str) -> None:
    manager = TransferManager("receiver", engine=engine)
    handle = open_in(manager, 1, state)
    stats_before = (manager.stats.late_events, manager.stats.invalid_events)
    applied = fire(handle, event)
    expected = ALLOWED.get((state, event))
    if expected is not None:
        assert applied is True
        assert handle.state is expected
        assert manager.status(1) is expected
        assert (manager.stats.late_events, manager.stats.invalid_events) == stats_before
    elif state in (S, F):
        # Rule 2: terminal absorbs, counted as late, nothing changes.
        assert applied is False
        assert handle.state is state
        assert manager.status(1) is state
        assert manager.stats.late_events == stats_before[0] + 1
    else:
        # Rule 3: out of order on a live room fails closed.
        assert applied is False
        assert handle.state is F
        assert manager.status(1) is F
        assert handle.failure is not None
        assert handle.failure.kind is FailureKind.INVALID_EVENT
        assert handle.failure.state is state
        assert event in handle.failure.message
        assert manager.stats.invalid_events == stats_before[1] + 1


REJECTED = [(s, e) for s, e in itertools.product(NON_TERMINAL, HANDLE_EVENTS) if (s, e) not in ALLOWED]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("state", "event"), REJECTED)
def test_strict_mode_raises_and_changes_nothing(engine: str, state: KVPoll, event: str) -> None:
    manager = TransferManager("sender", engine=engine, strict=True)
    handle = open_in(manager, "r", state)
    with pytest.raises(kvfsm.InvalidTransition) as info:
        fire(handle, event)
    err = info.value
    assert (err.room, err.state, err.event) == ("r", state, event)
    assert set(err.allowed) == {e for (s, e) in ALLOWED if s is state}
    assert handle.state is state
    assert manager.status("r") is state
    assert handle.failure is None
    assert manager.stats.invalid_events == 1


def test_strict_mode_still_absorbs_late_events() -> None:
    manager = TransferManager("sender", strict=True)
    handle = open_in(manager, 1, S)
    assert handle.abort() is False
    assert handle.state is S
    assert manager.stats.late_events == 1
