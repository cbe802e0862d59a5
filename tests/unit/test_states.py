"""States, roles, failure reasons and timeouts: values and validation."""

from __future__ import annotations

import pytest

import kvfsm
from kvfsm import FailureKind, FailureReason, KVPoll, Role, Timeouts


def test_kvpoll_keeps_sglang_values() -> None:
    assert [(s.name, int(s)) for s in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]
    # MIN all-reduce semantics: any failure is the minimum.
    assert min(KVPoll) is KVPoll.Failed
    assert max(KVPoll) is KVPoll.Success


def test_terminal_states() -> None:
    assert frozenset({KVPoll.Success, KVPoll.Failed}) == kvfsm.TERMINAL
    assert set(kvfsm.NON_TERMINAL) | kvfsm.TERMINAL == set(KVPoll)


@pytest.mark.parametrize(
    ("given", "expected"), [("sender", Role.SENDER), ("RECEIVER", Role.RECEIVER), (Role.SENDER, Role.SENDER)]
)
def test_role_coerce_accepts_roles_and_strings(given: object, expected: Role) -> None:
    assert Role.coerce(given) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["prefill", "", 3, None])
def test_unknown_role_is_a_config_error_naming_allowed_values(bad: object) -> None:
    with pytest.raises(kvfsm.ConfigError) as info:
        kvfsm.TransferManager(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert "'sender'" in str(info.value) and "'receiver'" in str(info.value)
    assert repr(bad) in str(info.value)


def test_failure_reason_validates_and_formats() -> None:
    reason = FailureReason(FailureKind.TIMEOUT, "waited too long", KVPoll.WaitingForInput, from_peer=True)
    assert str(reason) == "TIMEOUT in WaitingForInput (reported by peer): waited too long"
    assert FailureReason(FailureKind.ABORTED).message == ""
    with pytest.raises(TypeError, match="FailureKind"):
        FailureReason("timeout", "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="message must be a str"):
        FailureReason(FailureKind.TIMEOUT, 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state must be a kvfsm\.KVPoll"):
        FailureReason(FailureKind.TIMEOUT, "x", 3)  # type: ignore[arg-type]


def test_failure_kinds_are_the_designed_set() -> None:
    assert {k.name for k in FailureKind} == {
        "ABORTED",
        "TIMEOUT",
        "PEER_FAILED",
        "PEER_LOST",
        "TRANSFER_ERROR",
        "INVALID_EVENT",
        "BOOTSTRAP_ERROR",
    }


def test_timeouts_defaults_and_phases() -> None:
    t = Timeouts()
    assert (t.bootstrap, t.waiting, t.transferring, t.drain) == (300.0, 300.0, None, 30.0)
    assert t.for_state(KVPoll.Bootstrapping) == 300.0
    assert t.for_state(KVPoll.Transferring) is None
    assert t.for_state(KVPoll.Success) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_non_positive_timeouts_are_config_errors(bad: float) -> None:
    with pytest.raises(kvfsm.ConfigError, match=r"Timeouts\.waiting must be positive"):
        Timeouts(waiting=bad)


@pytest.mark.parametrize("bad", ["10", True, [1]])
def test_non_numeric_timeouts_are_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match=r"Timeouts\.bootstrap must be a number of seconds or None"):
        Timeouts(bootstrap=bad)  # type: ignore[arg-type]
