"""The KV lifecycle's table, under the names DESIGN.md made public.

The table is no longer written here: it is derived from the declaration
of `KV_LIFECYCLE` (`_lifecycle.py`), like every other lifecycle's. These
names are the KV lifecycle's rows, event names and initial state, kept
for code written against the one fixed lifecycle kvfsm used to have.

Read a row as: an event listed for a state moves the room to `dest`; an
event not listed for the current state is out of order (rule 3); a
terminal state lists nothing, so it absorbs every event (rule 2).
`dest=None` marks an internal transition: progress is recorded but the
state is not left, so no exit or entry hook runs and no deadline restarts.
`fail`, `timeout` and `abort` are allowed from every non-terminal state and
from no terminal one: that is the guard that makes `Failed` impossible to
overwrite and abort always safe.
"""

from __future__ import annotations

from ._lifecycle import FAILURE_EVENTS, KV_LIFECYCLE, TransitionSpec
from ._states import KVPoll

__all__ = ["TransitionSpec", "TRANSITIONS", "EVENTS", "INITIAL", "FAILURE_EVENTS"]

#: The initial state of the KV lifecycle.
INITIAL: KVPoll = KV_LIFECYCLE.initial  # type: ignore[assignment,unused-ignore]
#: The KV lifecycle's rows, the failure events included, in declaration order.
TRANSITIONS: tuple[TransitionSpec, ...] = KV_LIFECYCLE.transitions
#: Every event name of the KV lifecycle, in declaration order.
EVENTS: tuple[str, ...] = KV_LIFECYCLE.events
