"""The vocabulary of a transfer's lifecycle: states, roles, failure reasons.

Everything here is plain data with no behaviour beyond validation, so every
other module (the lifecycle declarations, the machine, the manager,
adapters, metrics) can import it without pulling anything else in. The
states a room passes through, `TERMINAL` and `Timeouts` are declared by a
lifecycle (`_lifecycle.py`); this module has what every lifecycle shares.

`KVPoll` keeps SGLang's integer values on purpose: servers all-reduce the
polled status across ranks with MIN, so `Failed=0` must stay the smallest
value ("any rank failed means the request failed everywhere") and `Success`
the largest ("every rank must succeed").
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import attrs

from ._root_errors import ConfigError

__all__ = [
    "RoomId",
    "MIN_INT_ROOM_ID",
    "MAX_INT_ROOM_ID",
    "MAX_ROOM_ID_CHARS",
    "MAX_REASON_CHARS",
    "KVPoll",
    "State",
    "Role",
    "FailureKind",
    "FailureReason",
]


#: A room id: SGLang's integer bootstrap room, or a string request id.
RoomId: TypeAlias = int | str

#: Room ids every method accepts and every control-plane frame can carry:
#: ints that fit 64 bits (signed or unsigned; SGLang's rooms are 63-bit),
#: strings of 1 to `MAX_ROOM_ID_CHARS` characters.
MIN_INT_ROOM_ID = -(1 << 63)
MAX_INT_ROOM_ID = (1 << 64) - 1
MAX_ROOM_ID_CHARS = 1024
#: Failure messages longer than this are cut (with a marker saying how much
#: was cut), so a reason always fits the frame that tells the peer.
MAX_REASON_CHARS = 2048


class KVPoll(enum.IntEnum):
    """The status of one transfer ("room"), with SGLang's values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


#: A lifecycle state: a member of its lifecycle's state enum (`KVPoll` itself for
#: the KV lifecycle; see `kvfsm.Lifecycle`). Their values index per-state tables.
State: TypeAlias = enum.IntEnum


class Role(str, enum.Enum):
    """Which side of a transfer a manager runs: prefill sends, decode receives."""

    SENDER = "sender"
    RECEIVER = "receiver"

    @classmethod
    def coerce(cls, value: Role | str) -> Role:
        """Accept a `Role` or its string value; anything else is a clear error."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(r.value) for r in cls)
        raise ConfigError(f"role must be a kvfsm.Role or one of {allowed}; got {value!r}")


class FailureKind(str, enum.Enum):
    """Why a room failed. The string values are stable labels for metrics."""

    ABORTED = "aborted"
    TIMEOUT = "timeout"
    PEER_FAILED = "peer_failed"
    PEER_LOST = "peer_lost"
    TRANSFER_ERROR = "transfer_error"
    INVALID_EVENT = "invalid_event"
    BOOTSTRAP_ERROR = "bootstrap_error"


def _check_kind(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, FailureKind):
        allowed = ", ".join(k.name for k in FailureKind)
        raise TypeError(f"FailureReason.kind must be a kvfsm.FailureKind ({allowed}); got {value!r}")


def _check_message(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"FailureReason.message must be a str; got {type(value).__name__}: {value!r:.200}")


def bounded_message(value: str) -> str:
    """Cut a failure message to `MAX_REASON_CHARS`, saying how much was cut.

    As `FailureReason.message`'s converter it also sees what is not a str;
    that passes through unchanged for the validator to refuse.
    """
    if value.__class__ is str and len(value) > MAX_REASON_CHARS:
        marker, previous = "", None
        while marker != previous:  # the marker's own length depends on the count it shows
            previous = marker
            marker = f" [... {len(value) - (MAX_REASON_CHARS - len(marker))} more characters cut]"
        return value[: MAX_REASON_CHARS - len(marker)] + marker
    return value


def _check_state(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, enum.IntEnum):
        raise TypeError(
            f"FailureReason.state must be a kvfsm.KVPoll (or another lifecycle's state) or None; got {value!r}"
        )


@attrs.frozen(slots=True)
class FailureReason:
    """A structured failure: what went wrong, in which state, and whose fault.

    `state` is the state the room was in when it failed. Leave it `None` when
    building a reason to pass to `handle.fail()`: the manager fills it in.
    `from_peer` is true when the other side of the transfer reported it.
    """

    kind: FailureKind = attrs.field(validator=_check_kind)
    message: str = attrs.field(default="", converter=bounded_message, validator=_check_message)
    state: State | None = attrs.field(default=None, validator=_check_state)
    from_peer: bool = attrs.field(default=False, converter=bool)

    def __str__(self) -> str:
        where = f" in {self.state.name}" if self.state is not None else ""
        peer = " (reported by peer)" if self.from_peer else ""
        text = f": {self.message}" if self.message else ""
        return f"{self.kind.name}{where}{peer}{text}"


def _seconds_or_none(name: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator of a deadline in seconds (None: no deadline); the errors name `Timeouts.<name>`."""
    if "." not in name:
        name = f"Timeouts.{name}"

    def check(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds or None; got {value!r}")
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be positive and finite (or None for no deadline); got {value!r}")

    return check
