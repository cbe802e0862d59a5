"""The lifecycle, declared once, as data.

This table is the single declaration of which event moves a room from which
state to which state. `_machine.py` builds the `transitions` machine from
it; the manager's dispatch table, the diagrams in the docs and the
exhaustive tests are all derived from that machine, so none of them can
drift from what is written here.

Read it as: an event listed for a state moves the room to `dest`; an event
not listed for the current state is out of order (rule 3); a terminal
state lists nothing, so it absorbs every event (rule 2). `dest=None` marks
an internal transition: progress is recorded but the state is not left, so
no exit or entry hook runs and no deadline restarts.

`fail`, `timeout` and `abort` are allowed from every non-terminal state and
from no terminal one: that is the guard that makes `Failed` impossible to
overwrite and abort always safe.
"""

from __future__ import annotations

import attrs

from ._states import NON_TERMINAL, KVPoll

__all__ = ["TransitionSpec", "TRANSITIONS", "EVENTS", "INITIAL", "FAILURE_EVENTS"]


@attrs.frozen(slots=True)
class TransitionSpec:
    """One row: `event` moves a room from any of `sources` to `dest`."""

    event: str
    sources: tuple[KVPoll, ...]
    dest: KVPoll | None
    doc: str


INITIAL = KVPoll.Bootstrapping

TRANSITIONS: tuple[TransitionSpec, ...] = (
    TransitionSpec(
        "bootstrapped",
        (KVPoll.Bootstrapping,),
        KVPoll.WaitingForInput,
        "handshake done: the peer is known and both sides hold each other's metadata",
    ),
    TransitionSpec(
        "transfer_started",
        (KVPoll.WaitingForInput,),
        KVPoll.Transferring,
        "the first chunk's write was issued",
    ),
    TransitionSpec(
        "chunk_done",
        (KVPoll.Transferring,),
        None,
        "one chunk landed (progress only: bytes, last-chunk time)",
    ),
    TransitionSpec(
        "transfer_done",
        (KVPoll.Transferring,),
        KVPoll.Success,
        "every chunk and the commit marker landed",
    ),
    TransitionSpec("fail", NON_TERMINAL, KVPoll.Failed, "a backend or peer reported a structured failure"),
    TransitionSpec("timeout", NON_TERMINAL, KVPoll.Failed, "the current phase's deadline passed"),
    TransitionSpec("abort", NON_TERMINAL, KVPoll.Failed, "the server gave up on the request"),
)

#: Every event name, in declaration order.
EVENTS: tuple[str, ...] = tuple(spec.event for spec in TRANSITIONS)
#: Events that end a room in `Failed`; each needs a `FailureReason`.
FAILURE_EVENTS: frozenset[str] = frozenset(s.event for s in TRANSITIONS if s.dest is KVPoll.Failed)
