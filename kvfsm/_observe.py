"""What observers receive: one immutable record per state change.

Metrics, tracing and logs subscribe to a manager (`manager.subscribe`) and
get a `StateChange` for every open, transition, progress step and close, in
the order they happened, never while the manager's lock is held.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ._release import PagesState
from ._states import FailureReason, Role, RoomId, State

__all__ = ["StateChange", "Observer"]


@attrs.frozen(slots=True)
class StateChange:
    """One step of one room's lifecycle.

    `event` is a lifecycle event, or `"open"` (source None, dest the
    initial state) or `"close"` (source the final state, dest None). An
    internal event (`chunk_done`) has source and dest both the room's state
    and `nbytes` / `last` describe the chunk. A step of the release phase
    of the room's pages (`drained`, `fenced`, `drain_deadline`,
    `drain_deadline_release`, `override`) has `pages` set to where the
    pages went, source and dest the room's unchanged state, and `nbytes` the
    bytes the pages hold. `time` is the manager's clock reading.
    """

    role: Role
    room: RoomId
    generation: int
    event: str
    source: State | None
    dest: State | None
    time: float
    reason: FailureReason | None = None
    nbytes: int = 0
    last: bool = False
    pages: PagesState | None = None


Observer = Callable[[StateChange], None]
