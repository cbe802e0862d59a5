"""Every error: its place in the hierarchy and a message that names what went wrong."""

from __future__ import annotations

import pytest

import kvfsm
from kvfsm import FailureKind, FailureReason, KVPoll


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (kvfsm.ConfigError, ValueError),
        (kvfsm.KVTransferError, RuntimeError),
        (kvfsm.InvalidTransition, RuntimeError),
        (kvfsm.DuplicateRoom, ValueError),
        (kvfsm.UnknownRoom, KeyError),
        (kvfsm.RoomNotFailed, RuntimeError),
    ],
)
def test_errors_share_one_root_and_resemble_a_builtin(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, kvfsm.KVFSMError)
    assert issubclass(error, builtin)


def test_kv_transfer_error_carries_room_and_reason() -> None:
    reason = FailureReason(FailureKind.PEER_LOST, "no heartbeat for 10s", KVPoll.Transferring, from_peer=True)
    err = kvfsm.KVTransferError(7, reason)
    assert err.room == 7 and err.reason is reason and err.is_from_another_rank
    assert (
        str(err) == "KV transfer of room 7 failed: PEER_LOST in Transferring (reported by peer): no heartbeat for 10s"
    )
    assert "no reason recorded" in str(kvfsm.KVTransferError(7, None))


def test_invalid_transition_names_room_state_event_and_allowed() -> None:
    err = kvfsm.InvalidTransition("r1", KVPoll.Bootstrapping, "transfer_done", ["bootstrapped", "abort"])
    text = str(err)
    for part in ("'r1'", "Bootstrapping", "'transfer_done'", "bootstrapped, abort"):
        assert part in text


def test_unknown_room_message_is_not_a_tuple_repr() -> None:
    err = kvfsm.UnknownRoom(3, "it was never opened")
    assert str(err) == "room 3 is not open: it was never opened"
