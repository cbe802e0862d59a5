"""kvfsm's exceptions: one root, each also a subclass of the builtin it resembles.

`except kvfsm.KVFSMError` catches everything the library raises on purpose;
`except KeyError` still catches an unknown room, `except ValueError` a bad
configuration, so code written against dict-and-flag lifecycles keeps working.
Every message names what was expected and what arrived.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._root_errors import ConfigError, KVFSMError
from ._states import FailureReason, RoomId, State

__all__ = [
    "KVFSMError",
    "ConfigError",
    "KVTransferError",
    "InvalidTransition",
    "DuplicateRoom",
    "UnknownRoom",
    "RoomNotFailed",
    "InvalidRoomId",
    "NotQuarantined",
]


class KVTransferError(KVFSMError, RuntimeError):
    """A room's transfer failed; carries the room and the structured reason."""

    def __init__(self, room: RoomId, reason: FailureReason | None) -> None:
        self.room = room
        self.reason = reason
        super().__init__(room, reason)

    @property
    def is_from_another_rank(self) -> bool:
        """SGLang's name for "the reason was reported by the peer"."""
        return self.reason is not None and self.reason.from_peer

    def __str__(self) -> str:
        if self.reason is None:
            return f"KV transfer of room {self.room!r} failed (no reason recorded)"
        return f"KV transfer of room {self.room!r} failed: {self.reason}"


class InvalidTransition(KVFSMError, RuntimeError):
    """Strict mode: an event arrived that the room's current state does not accept."""

    def __init__(self, room: RoomId, state: State, event: str, allowed: Iterable[str]) -> None:
        self.room = room
        self.state = state
        self.event = event
        self.allowed = tuple(allowed)
        super().__init__(room, state, event, self.allowed)

    def __str__(self) -> str:
        allowed = ", ".join(self.allowed) or "none (terminal)"
        return (
            f"room {self.room!r} is {self.state.name}: event {self.event!r} is not allowed there (allowed: {allowed})"
        )


class DuplicateRoom(KVFSMError, ValueError):
    """`open()` was called for a room that is already open."""

    def __init__(self, room: RoomId, state: State, generation: int) -> None:
        self.room = room
        self.state = state
        self.generation = generation
        super().__init__(room, state, generation)

    def __str__(self) -> str:
        return (
            f"room {self.room!r} is already open (generation {self.generation}, {self.state.name}); "
            f"close it before opening it again"
        )


class UnknownRoom(KVFSMError, KeyError):
    """A room was looked up that is not open: never opened, or already closed."""

    def __init__(self, room: RoomId, detail: str) -> None:
        self.room = room
        self.detail = detail
        super().__init__(room, detail)

    def __str__(self) -> str:
        # KeyError's own __str__ would show the repr of the args tuple.
        return f"room {self.room!r} is not open: {self.detail}"


class RoomNotFailed(KVFSMError, RuntimeError):
    """`failure_exception()` was asked of a room that has not failed."""

    def __init__(self, room: RoomId, state: State) -> None:
        self.room = room
        self.state = state
        super().__init__(room, state)

    def __str__(self) -> str:
        return f"room {self.room!r} has not failed (it is {self.state.name}); there is no failure to raise"


class InvalidRoomId(KVFSMError, TypeError, ValueError):
    """A room id that no manager method accepts: not an int or str, or beyond what the wire carries.

    It is a `TypeError` for a value of the wrong type (`True`, `1.0`, `None`)
    and a `ValueError` for one out of range (`""`, a 2,000-character string,
    an int beyond 64 bits); catch it as either, or as `KVFSMError`.
    """

    def __init__(self, room: object, expected: str) -> None:
        self.room = room
        self.expected = expected
        super().__init__(room, expected)

    def __str__(self) -> str:
        shown = repr(self.room)
        if len(shown) > 80:
            shown = f"{shown[:60]}... ({len(shown)} characters)"
        return f"room must be {self.expected}; got {type(self.room).__name__}: {shown}"


class NotQuarantined(KVFSMError, ValueError):
    """`release_quarantined(room, why)` named a room no generation of which has quarantined pages."""

    def __init__(self, room: RoomId, pages: str) -> None:
        self.room = room
        self.pages = pages
        super().__init__(room, pages)

    def __str__(self) -> str:
        return f"room {self.room!r} has no quarantined pages to release (expected quarantined; got {self.pages})"
