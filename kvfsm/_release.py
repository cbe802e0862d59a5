"""The release phase of a room's pages, declared: pages are freed only on proof.

A room's transfer and a room's pages end at different times. The transfer
is over when the room is terminal; the pages the server gave it may still
be written by a peer after that, if the room failed while a write was in
flight (SGLang #24527, #38961; vLLM #52234). So the pages have a small
lifecycle of their own, declared here as a `Table` (the one table
mechanism, `_rows.py`) and written by one step function
(`_status.pages_step`):

    Held ──succeeded──▶ Released            (Success: every write landed)
    Held ──failed─────▶ Draining            (the room failed: wait for proof)
    Draining ──drained | fenced──▶ Released (proof that no write can land)
    Draining ──drain_deadline────▶ Quarantined  (no proof in time: never reused)
    Draining ──drain_deadline_release──▶ Released  (opt-in: the old timer)
    Quarantined ──drained | fenced──▶ Released   (the proof came late)
    Quarantined ──override───────▶ Released      (an operator's counted decision)

Proof is one of: the backend's drain (`handle.writes_drained()`: its engine
reports no write of the room in flight, or the prefill's ABORT_ACK after
its writer drained), or a fence (`handle.fenced(why)`: the engine says the
peer's connection is closed or its process gone, or the peer's next
incarnation says the old one holds no writes). A drain deadline that
passes without either quarantines the pages: not release-safe, counted in
rooms and bytes, logged once. `on_drain_deadline="release"` restores the
timer (`drain_deadline_release`), with its risk: a peer that was only slow
writes into pages the server already gave to another request.

Not a lifecycle event of the transfer: none of this changes the room's
state or its `KVPoll` status (rule 6). It outlives `close()`: a closed
room whose pages are not released is remembered until they are.
"""

from __future__ import annotations

import enum

from ._rows import Row, Table

__all__ = ["PagesState", "RELEASE_TABLE", "PROOFS", "DRAIN_POLICIES"]


class PagesState(str, enum.Enum):
    """Where a room's pages stand; only `RELEASED` may be freed."""

    HELD = "held"
    DRAINING = "draining"
    QUARANTINED = "quarantined"
    RELEASED = "released"


_P = PagesState

RELEASE_TABLE = Table(
    "release",
    PagesState,
    (
        Row("succeeded", (_P.HELD,), _P.RELEASED, (), "the room succeeded: every write into its pages landed"),
        Row("failed", (_P.HELD,), _P.DRAINING, (), "the room failed: its pages wait for proof that no write can land"),
        Row(
            "drained",
            (_P.DRAINING, _P.QUARANTINED),
            _P.RELEASED,
            (),
            "proof: the backend's drain (no write in flight, or the prefill's ABORT_ACK)",
        ),
        Row(
            "fenced",
            (_P.DRAINING, _P.QUARANTINED),
            _P.RELEASED,
            (),
            "proof: the peer is fenced (connection closed, process gone, next incarnation holds no writes)",
        ),
        Row(
            "drain_deadline",
            (_P.DRAINING,),
            _P.QUARANTINED,
            (),
            "no proof by Timeouts.drain: quarantined (not release-safe; counted; logged once)",
        ),
        Row(
            "drain_deadline_release",
            (_P.DRAINING,),
            _P.RELEASED,
            (),
            'no proof by Timeouts.drain, on_drain_deadline="release": freed anyway (opt-in, unsafe)',
        ),
        Row(
            "override",
            (_P.QUARANTINED,),
            _P.RELEASED,
            (),
            "release_quarantined(room, why): an operator's counted override",
        ),
    ),
    "The release phase of a room's pages: freed on proof only (DESIGN.md rules 6 and 13).",
)

#: The inputs that prove no write of the room can land any more.
PROOFS: frozenset[str] = frozenset({"drained", "fenced"})
#: What a manager may do when the drain deadline passes without proof.
DRAIN_POLICIES: dict[str, str] = {"quarantine": "drain_deadline", "release": "drain_deadline_release"}
