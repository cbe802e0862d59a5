"""Translating integer status writes into lifecycle events.

Backends written against SGLang's `CommonKVManager` write statuses:
`update_status(room, KVPoll.Success)`, `request_status.pop(room)`,
`record_failure(room, "...")`. kvfsm has one writer, the machine, so these
writes cannot be stored as they are. This module turns each of them into
the event(s) that lead there, and hands back what the machine decided.

The translation keeps what `max(old, new)` was meant to do and drops what
it got wrong:

* forward moves become the chain of events between the two states, read
  from the room's lifecycle (`Lifecycle.forward_events`: `Success` written
  over `WaitingForInput` fires `transfer_started` then `transfer_done`, so
  the room passes through `Transferring` and the transfer-latency window
  is recorded); the written value is what a state reports, so a lifecycle
  with more states (a staging phase reporting WaitingForInput) maps onto
  SGLang's integers with no arithmetic on them;
* a backward or equal non-terminal write is a no-op, as `max` made it;
* a write onto a terminal room is absorbed by the machine and counted
  (a late `Success` never overwrites `Failed`);
* `Failed` becomes a `fail` event carrying the reason recorded earlier
  with `record_failure`.

`RequestStatusView` and `FailureRecordsView` are the dict-shaped faces the
old code reads and writes; every write goes through the manager.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from ..._lifecycle import KV_LIFECYCLE, Lifecycle
from ..._manager import TransferHandle
from ..._states import KVPoll, RoomId, State

__all__ = ["FORWARD_EVENTS", "forward_events", "drive_to", "RequestStatusView", "FailureRecordsView"]

#: The event that leaves each non-terminal state of the KV lifecycle forwards (derived from its declaration).
FORWARD_EVENTS: dict[KVPoll, str] = {
    KVPoll(state): KV_LIFECYCLE.forward_events(state, KV_LIFECYCLE.reports[KV_LIFECYCLE.successes[0]])[0]
    for state in KV_LIFECYCLE.non_terminal
}


def forward_events(current: State, target: KVPoll, lifecycle: Lifecycle = KV_LIFECYCLE) -> tuple[str, ...]:
    """The events that move a room forward from `current` to a state reporting `target`.

    Empty when `target` is not ahead of what `current` reports (what `max`
    made a no-op). Not meant for `Failed`, which is a `fail` event, nor for
    a terminal `current`, which absorbs everything. The chain is the
    lifecycle's shortest (`Lifecycle.forward_events`): for a lifecycle with
    a staging phase, `Transferring` written over `WaitingForInput` goes
    straight there.
    """
    return lifecycle.forward_events(current, target)


def drive_to(handle: TransferHandle, target: KVPoll) -> bool:
    """Fire the forward events from the handle's current state to a state reporting `target`.

    Re-reads the state before each event, so an abort landing in between
    makes the remaining events late (absorbed, counted) rather than out of
    order. On a terminal room, the event that would have reached `target`
    is still fired so the machine counts it as late. Returns whether the
    room now reports `target`.
    """
    lifecycle = handle.lifecycle
    reports = lifecycle.reports
    if handle.state in lifecycle.terminal:
        if reports[handle.state] is not target:
            _fire(handle, lifecycle.event_into(target) or lifecycle.events[0])
        return reports[handle.state] is target
    for _ in range(len(lifecycle.State)):
        state = handle.state
        if reports[state] >= target or state in lifecycle.terminal:
            break
        events = lifecycle.forward_events(state, target)
        if not events or not _fire(handle, events[0]):
            break
    return reports[handle.state] is target


def _fire(handle: TransferHandle, event: str) -> bool:
    method = getattr(handle, event)
    return bool(method())


class _StatusWriter(Protocol):
    """What the views need of the manager they front."""

    def check_status(self, bootstrap_room: int) -> KVPoll: ...

    def update_status(self, bootstrap_room: int, status: KVPoll | int) -> bool: ...

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None: ...

    def close_room(self, bootstrap_room: int) -> KVPoll | None: ...

    def open_rooms(self) -> list[RoomId]: ...

    def failure_message(self, bootstrap_room: int) -> str | None: ...


_MISSING: Any = object()


class RequestStatusView(Mapping[int, KVPoll]):
    """`kv_mgr.request_status`: room -> status, as SGLang's dict was.

    Reads ask the machine (deadlines enforced); `view[room] = status` is
    `update_status`; `pop(room, default)` and `del view[room]` close the
    room (what SGLang's `clear()` does). A closed room is not listed and
    `view[room]` raises `kvfsm.UnknownRoom` (a `KeyError`) naming why.
    """

    __slots__ = ("_manager",)

    def __init__(self, manager: _StatusWriter) -> None:
        self._manager = manager

    def __getitem__(self, room: int) -> KVPoll:
        return self._manager.check_status(room)

    def __iter__(self) -> Iterator[int]:
        return iter(self._manager.open_rooms())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._manager.open_rooms())

    def __setitem__(self, room: int, status: KVPoll | int) -> None:
        self._manager.update_status(room, status)

    def __delitem__(self, room: int) -> None:
        if self._manager.close_room(room) is None:
            raise KeyError(room)

    def pop(self, room: int, default: Any = _MISSING) -> Any:
        """Close the room and return its final status (or `default` if it was not open)."""
        return _found_or_default(room, self._manager.close_room(room), default)

    def __repr__(self) -> str:
        return f"<RequestStatusView {dict(self.items())!r}>"


def _found_or_default(room: int, value: Any, default: Any) -> Any:
    """`dict.pop`'s answer: the value, else `default`, else `KeyError` when none was given."""
    if value is not None:
        return value
    if default is _MISSING:
        raise KeyError(room)
    return default


class FailureRecordsView(Mapping[int, str]):
    """`kv_mgr.failure_records`: room -> failure message, as SGLang's dict was.

    A room is listed once it failed (the machine's recorded reason) or
    while a `record_failure` message waits for its `update_status(Failed)`.
    `pop` only reads: the reason lives until the room is closed, so a
    second reader (another rank's `failure_exception`) still finds it.
    `view[room] = message` is `record_failure`.
    """

    __slots__ = ("_manager",)

    def __init__(self, manager: _StatusWriter) -> None:
        self._manager = manager

    def __getitem__(self, room: int) -> str:
        message = self._manager.failure_message(room)
        if message is None:
            raise KeyError(room)
        return message

    def __iter__(self) -> Iterator[int]:
        rooms = [room for room in self._manager.open_rooms() if self._manager.failure_message(room) is not None]  # type: ignore[arg-type]
        return iter(rooms)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, room: int, message: str) -> None:
        self._manager.record_failure(room, message)

    def pop(self, room: int, default: Any = _MISSING) -> Any:
        return _found_or_default(room, self._manager.failure_message(room), default)
