"""The errors every adapter raises, apart so that the memory types and the protocol share them."""

from __future__ import annotations

from collections.abc import Hashable

from .._errors import KVFSMError

__all__ = ["BackendError", "TransferInputError"]


class BackendError(KVFSMError, RuntimeError):
    """An adapter cannot do what was asked (not set up, closed, engine missing)."""


class TransferInputError(KVFSMError, ValueError):
    """Bad input for one room's transfer: the room is named and what was wrong.

    When raised for an open, live room, that room was failed first with
    `FailureKind.TRANSFER_ERROR` and the same message.
    """

    def __init__(self, room: Hashable, problem: str) -> None:
        self.room = room
        self.problem = problem
        super().__init__(room, problem)

    def __str__(self) -> str:
        return f"room {self.room!r}: {self.problem}"
