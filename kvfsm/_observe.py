"""What observers receive: one immutable record per state change.

Metrics, tracing and logs subscribe to a manager (`manager.subscribe`) and
get a `StateChange` for every open, transition, progress step and close, in
the order they happened, never while the manager's lock is held.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ._states import FailureReason, KVPoll, Role, RoomId

__all__ = ["StateChange", "Observer"]


@attrs.frozen(slots=True)
class StateChange:
    """One step of one room's lifecycle.

    `event` is a table event, or `"open"` (source None, dest Bootstrapping)
    or `"close"` (source the final state, dest None). `chunk_done` is an
    internal step: source and dest are both Transferring and `nbytes` /
    `last` describe the chunk. `time` is the manager's clock reading.
    """

    role: Role
    room: RoomId
    generation: int
    event: str
    source: KVPoll | None
    dest: KVPoll | None
    time: float
    reason: FailureReason | None = None
    nbytes: int = 0
    last: bool = False


Observer = Callable[[StateChange], None]
