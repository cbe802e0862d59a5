"""The wire protocol between a decode and a prefill endpoint, declared once, as data.

`_table.py` declares a room's lifecycle; this module declares what two
processes say to each other about it. Nothing here does IO: no sockets, no
threads, no torch. The ZeroMQ transport (`control.py`) only carries the
bytes this module encodes; the two halves of a remote endpoint
(`_remote_receiver.py` for the decode, `_remote_sender.py` and
`_remote_writer.py` for the prefill) move each room's wire record only
through `step()` over the tables below, so a frame the tables do not expect
in a record's state is dropped and counted, by construction. The docs draw
these tables (`mermaid()`), and a model-based test runs both halves over a
simulated hostile network (tests/property/test_wire_model.py).

Messages (`MESSAGES`)
    Session messages set up and keep a session between one decode and one
    prefill endpoint: HELLO / HELLO_ACK (handshake), HEARTBEAT, BYE. Room
    messages name one transfer: ROOM (decode -> prefill: the decode's pages
    and aux slot, its claim on the prefill's room), CHUNK and DONE (prefill
    -> decode: progress and completion; DONE carries the aux bytes when both
    aux pools are host memory), ABORT (either way) and ABORT_ACK (prefill ->
    decode: none of this transfer's writes is in flight any more).

Generations (rule 12)
    Every room message names `room` and `gen`: the decode's generation of
    that room, a random 63-bit number minted at each `bootstrap()`, so two
    opens of one room id never share it, not even across restarts. Frames
    from the prefill also carry `pgen`, the prefill's own generation the
    claim was bound to; the decode pins it on first sight. A frame whose
    (room, gen, pgen) names no live record of its session is dropped.

Claims, and why a room id alone cannot pair a reused room
    Both schedulers know a transfer only by its room id, so when a prefill
    reopens a room id whose previous generation ended before any decode
    claimed it, the next ROOM for that id may be the old transfer's late
    claim or the new one's early one: nothing on the wire tells them apart.
    kvfsm never guesses. A room id whose prefill generation ended
    unclaimed is held (ORPHANED) for `pending_ttl`: every ROOM for it is
    refused with that failure, and a new prefill generation of it fails at
    bootstrap. A claim is bound only when exactly one claim and one prefill
    generation can belong together; any ambiguity fails both sides. Wrong
    KV is impossible; the price is a failed request when a room id is
    reused within `pending_ttl` of an unclaimed failure (SGLang's room ids
    are random 63-bit numbers: reuse is a deliberate retry).

Sessions (rule 15)
    HELLO carries a session id and secret minted by the decode, HELLO_ACK
    the prefill's; every later frame carries the id and secret its receiver
    minted (`sid`, `key`), compared in constant time. Only a session's own
    frames can complete, fail or abort its rooms; an address or id that a
    frame claims never does. With a shared key configured, HELLO and
    HELLO_ACK carry an HMAC-SHA256 over their bytes, so only holders of
    the key can open a session at all.

    The handshake has three legs: HELLO, HELLO_ACK, and the decode's first
    frame of the session (a HEARTBEAT at once), which confirms it; the
    prefill answers that confirmation with a HEARTBEAT of its own, and only
    then is the session up on the decode (its rooms bootstrapped). A BYE
    before that means "not accepted" (a half-open session evicted to make
    room, or no room at all): the decode tries again with a new session
    (`_remote_receiver`), so a burst of decodes larger than the prefill's
    half-open bound still gets in, and none believes in a session the
    prefill dropped.

Envelopes (rule 15, work bounded before parsing)
    A frame's session id, secret and MAC travel in a small envelope frame
    before the JSON header (`TYPE [sid key] [mac]`, at most
    `MAX_ENVELOPE_BYTES`), so an endpoint authenticates a frame, or checks
    a handshake's MAC, before it parses a byte of JSON: a frame naming no
    session costs a dictionary lookup whatever its size. Only HELLO is
    parsed without a session, and its header is bounded apart
    (`MAX_HELLO_BYTES`).

Bounds (rule 15)
    Frame count, header and blob sizes, text lengths and page-list lengths
    are bounded here; `codec.decode()` turns every way a frame can be
    wrong (JSON that raises `ValueError` or `RecursionError`, bad UTF-8, a
    wrong type) into a `MalformedFrame` with a counter category, never
    another exception.

Frames (`codec.py`)
    How a message becomes bytes and back, and the handshake's HMAC, live
    in `codec.py`: this module is what the protocol says, that one how it
    is spelled on the wire.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from .._rows import Row, Table
from .._states import MAX_INT_ROOM_ID, MAX_REASON_CHARS, MAX_ROOM_ID_CHARS, MIN_INT_ROOM_ID

__all__ = [
    "MAGIC",
    "MAX_BLOB_BYTES",
    "MAX_ENVELOPE_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_HELLO_BYTES",
    "MAX_PAGES",
    "MAX_TEXT",
    "MESSAGES",
    "SPECS",
    "DecodeWire",
    "PrefillClaim",
    "PrefillRoom",
    "MessageSpec",
    "WireRow",
    "WireTable",
    "DECODE_TABLE",
    "CLAIM_TABLE",
    "ROOM_TABLE",
    "TABLES",
    "mermaid",
    "CHECK_DOCS",
    "room_id_ok",
    "sends_table",
    "token_ok",
]

#: First frame of every message: protocol name and version.
MAGIC = b"KVFSM/3"
#: Largest envelope frame (`TYPE [sid key] [mac]`, read before any JSON).
MAX_ENVELOPE_BYTES = 256
#: Largest JSON header frame: a ROOM listing `MAX_PAGES` pages fits.
MAX_HEADER_BYTES = 6 << 20
#: Largest header of a HELLO or HELLO_ACK: parsed before any session vouches for the
#: sender, so bounded well below `MAX_HEADER_BYTES` (a pool layout of 4096 regions fits).
MAX_HELLO_BYTES = 1 << 20
#: Largest binary frame (engine metadata in a handshake, aux bytes in DONE).
MAX_BLOB_BYTES = 1 << 20
#: Longest text field (engine names, addresses, reasons once cut).
MAX_TEXT = 4096
#: Most pages one ROOM may list (128k-token prompts at one token per page fit four times).
MAX_PAGES = 1 << 19
#: Generations are positive 63-bit numbers (JSON ints every peer parses exactly).
MAX_GEN = (1 << 63) - 1
#: A decode's commit-marker region (`_markers`): at most this many slots; tokens 1..MAX_TOKEN.
MAX_MARKER_SLOTS = 1 << 20
MAX_TOKEN = (1 << 63) - 1
# A reason travels as text of at most this; the core already cuts longer ones.
assert MAX_REASON_CHARS <= MAX_TEXT and MAX_ROOM_ID_CHARS <= MAX_TEXT


# -- field checks -----------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return value.__class__ is int


def room_id_ok(value: Any) -> bool:
    """A room id every manager accepts (see kvfsm._manager._check_room_id)."""
    if value.__class__ is int:
        return MIN_INT_ROOM_ID <= value <= MAX_INT_ROOM_ID
    return value.__class__ is str and 0 < len(value) <= MAX_ROOM_ID_CHARS


def _gen(value: Any) -> bool:
    return _is_int(value) and 0 < value <= MAX_GEN


def _opt_gen(value: Any) -> bool:
    return value is None or (_is_int(value) and 0 <= value <= MAX_GEN)


def _pgen(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_GEN


def _text(value: Any) -> bool:
    return value.__class__ is str and len(value) <= MAX_TEXT


def token_ok(value: Any) -> bool:
    """A session id, secret or MAC as an envelope carries it."""
    return _token(value)


def _token(value: Any) -> bool:
    # A session id or secret goes back in an envelope: printable ASCII, no spaces.
    return (
        value.__class__ is str and 0 < len(value) <= 64 and value.isascii() and value.isprintable() and " " not in value
    )


def _count(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_GEN


def _opt_count(value: Any) -> bool:
    return value is None or _count(value)


def _mapping(value: Any) -> bool:
    return value.__class__ is dict and all(k.__class__ is str for k in value)


def _marker(value: Any) -> bool:
    # None, or [slot, token]: the decode's marker slot for the room and the token it minted.
    return value is None or (
        value.__class__ is list
        and len(value) == 2
        and _is_int(value[0])
        and _is_int(value[1])
        and 0 <= value[0] < MAX_MARKER_SLOTS
        and 0 < value[1] <= MAX_TOKEN
    )


def _pages(value: Any) -> bool:
    return (
        value.__class__ is list
        and len(value) <= MAX_PAGES
        and all(p.__class__ is int and 0 <= p <= MAX_GEN for p in value)
    )


Check = Callable[[object], bool]
CHECK_DOCS: dict[Check, str] = {
    room_id_ok: f"a room id (an int of 64 bits or a str of 1 to {MAX_ROOM_ID_CHARS} characters)",
    _gen: "a generation (an int in 1..2**63-1)",
    _opt_gen: "a generation or null",
    _pgen: "a prefill generation (an int >= 0)",
    _text: f"a str of at most {MAX_TEXT} characters",
    _token: "a session id or secret (1 to 64 printable ASCII characters, no spaces)",
    _count: "an int >= 0",
    _opt_count: "an int >= 0 or null",
    _mapping: "a JSON object",
    _pages: f"a list of at most {MAX_PAGES} page indices (ints >= 0)",
    _marker: f"null or [slot, token]: a slot in 0..{MAX_MARKER_SLOTS - 1} and a token in 1..2**63-1",
}


# -- the messages ---------------------------------------------------------------------------


class Scope(str, enum.Enum):
    SESSION = "session"
    ROOM = "room"


class Sender(str, enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"
    EITHER = "either"


@attrs.frozen(slots=True)
class MessageSpec:
    """One message type: who sends it, what it is about, its fields and whether a blob may follow."""

    name: str
    sender: Sender
    scope: Scope
    fields: tuple[tuple[str, Check], ...]
    blob: bool
    doc: str

    @property
    def authenticated(self) -> bool:
        """Whether the envelope carries its receiver's session id and secret (every message but HELLO)."""
        return self.name != "HELLO"

    @property
    def handshake(self) -> bool:
        """Whether the envelope may carry a MAC of the shared key (HELLO and HELLO_ACK)."""
        return self.name in ("HELLO", "HELLO_ACK")

    @property
    def max_header(self) -> int:
        """The largest JSON header this message may have (checked before it is parsed)."""
        return MAX_HELLO_BYTES if self.handshake else MAX_HEADER_BYTES


_REPLY: tuple[tuple[str, Check], ...] = (("reply_sid", _token), ("reply_key", _token))
_HANDSHAKE: tuple[tuple[str, Check], ...] = (
    ("role", _text),
    ("engine", _text),
    ("session", _mapping),
)

MESSAGES: tuple[MessageSpec, ...] = (
    MessageSpec(
        "HELLO",
        Sender.DECODE,
        Scope.SESSION,
        (("addr", _text), *_REPLY, *_HANDSHAKE),
        True,
        "first contact: where to answer, the session id and secret the prefill must use, "
        "the decode's engine session and pool layout (engine metadata in the blob)",
    ),
    MessageSpec(
        "HELLO_ACK",
        Sender.PREFILL,
        Scope.SESSION,
        (*_REPLY, *_HANDSHAKE, ("refused", _text)),
        True,
        "the answer, to the HELLO's address: the prefill's session id and secret, engine session "
        "and pools, or why it refused (refused is empty when it did not)",
    ),
    MessageSpec("HEARTBEAT", Sender.EITHER, Scope.SESSION, (), False, "a sign of life"),
    MessageSpec(
        "BYE",
        Sender.EITHER,
        Scope.SESSION,
        (),
        False,
        "shutting down on purpose: do not wait for the window; before the session is up: not accepted, try again",
    ),
    MessageSpec(
        "ROOM",
        Sender.DECODE,
        Scope.ROOM,
        (("room", room_id_ok), ("gen", _gen), ("pages", _pages), ("aux", _opt_count), ("marker", _marker)),
        False,
        "the decode's claim on the prefill's room: its generation, destination pages, aux slot and "
        "commit-marker slot and token (None: complete it with DONE only)",
    ),
    MessageSpec(
        "CHUNK",
        Sender.PREFILL,
        Scope.ROOM,
        (("room", room_id_ok), ("gen", _gen), ("pgen", _pgen), ("nbytes", _count)),
        False,
        "every write of one middle chunk landed",
    ),
    MessageSpec(
        "DONE",
        Sender.PREFILL,
        Scope.ROOM,
        (("room", room_id_ok), ("gen", _gen), ("pgen", _pgen), ("nbytes", _count)),
        True,
        "every write of the transfer landed and the prefill's room succeeded; the blob is the aux "
        "slot's bytes when they were not written by the engine",
    ),
    MessageSpec(
        "ABORT",
        Sender.EITHER,
        Scope.ROOM,
        (
            ("room", room_id_ok),
            ("gen", _gen),
            ("pgen", _opt_gen),
            ("kind", _text),
            ("message", _text),
        ),
        False,
        "this side's room failed (kind and message are its FailureReason)",
    ),
    MessageSpec(
        "ABORT_ACK",
        Sender.PREFILL,
        Scope.ROOM,
        (("room", room_id_ok), ("gen", _gen), ("pgen", _opt_gen)),
        False,
        "none of this transfer's writes is in flight: the decode may release its pages",
    ),
)

SPECS: dict[str, MessageSpec] = {spec.name: spec for spec in MESSAGES}


# -- per-room wire states and their tables ----------------------------------------------------------


class DecodeWire(str, enum.Enum):
    """A decode room's wire state (one record per decode generation)."""

    HANDSHAKE = "handshake"
    READY = "ready"
    CLAIMED = "claimed"
    RECEIVING = "receiving"
    DONE = "done"
    ABORTING = "aborting"
    PEER_ABORTED = "peer_aborted"
    UNTOLD = "untold"
    SETTLED = "settled"
    LOST = "lost"


class PrefillClaim(str, enum.Enum):
    """A decode's claim as the prefill holds it (one record per (session, room, gen))."""

    EARLY = "early"
    BOUND = "bound"
    WRITING = "writing"
    DONE = "done"
    STOPPING = "stopping"
    ACKED = "acked"


class PrefillRoom(str, enum.Enum):
    """A room id on the prefill, as far as claims go (one record per room id)."""

    UNCLAIMED = "unclaimed"
    CLAIMED = "claimed"
    FAILED = "failed"
    ORPHANED = "orphaned"


# The wire's tables are kvfsm's one table mechanism (`_rows.py`), the same row
# type and step as a lifecycle's, the release phase's and the SGLang request
# view's: `input` moves a record from any of `sources` (None: a record that
# does not exist yet) to `dest` (None: the record is dropped), sending `sends`.
WireRow = Row
WireTable = Table


_D = DecodeWire
DECODE_TABLE = WireTable(
    "decode",
    DecodeWire,
    (
        WireRow("bootstrap", (None,), _D.HANDSHAKE, (), "bootstrap(): HELLO goes out if no session is up"),
        WireRow("session_up", (_D.HANDSHAKE,), _D.READY, (), "the prefill answered: the room is bootstrapped"),
        WireRow("session_up", (_D.UNTOLD,), _D.SETTLED, ("ABORT",), "failed before the answer: tell the prefill now"),
        WireRow("session_refused", (_D.HANDSHAKE, _D.UNTOLD), _D.SETTLED, (), "the prefill refused the session"),
        WireRow("expect", (_D.READY,), _D.CLAIMED, ("ROOM",), "expect(): claim the prefill's room with our pages"),
        WireRow("recv CHUNK", (_D.CLAIMED, _D.RECEIVING), _D.RECEIVING, (), "a middle chunk landed"),
        WireRow("recv DONE", (_D.CLAIMED, _D.RECEIVING), _D.DONE, (), "everything landed: Success"),
        WireRow("marker", (_D.CLAIMED, _D.RECEIVING), _D.DONE, (), "our token is in the room's marker slot: Success"),
        WireRow("recv ABORT", (_D.CLAIMED, _D.RECEIVING), _D.PEER_ABORTED, (), "the prefill failed: wait for its ACK"),
        WireRow("recv ABORT", (_D.ABORTING,), _D.ABORTING, (), "both sides failed: still wait for the ACK"),
        WireRow(
            "recv ABORT_ACK",
            (_D.ABORTING, _D.PEER_ABORTED),
            _D.SETTLED,
            (),
            "no write of this transfer is in flight: release-safe",
        ),
        WireRow("fail", (_D.HANDSHAKE,), _D.UNTOLD, (), "failed before the session was up"),
        WireRow("fail", (_D.READY,), _D.SETTLED, ("ABORT",), "failed before claiming: nothing can land"),
        WireRow(
            "fail",
            (_D.CLAIMED, _D.RECEIVING),
            _D.ABORTING,
            ("ABORT",),
            "failed after claiming: the prefill may be writing, wait for its ACK",
        ),
        WireRow("fail", (_D.DONE,), _D.SETTLED, (), "failed after DONE: every write had landed already"),
        WireRow("fail", (_D.PEER_ABORTED,), _D.PEER_ABORTED, (), "our own echo of the prefill's ABORT"),
        WireRow("fail", (_D.LOST,), _D.LOST, (), "our own echo of the lost session"),
        WireRow("fail", (_D.SETTLED,), _D.SETTLED, (), "our own echo of a refused session"),
        WireRow(
            "session_lost", (_D.HANDSHAKE, _D.READY, _D.UNTOLD), _D.SETTLED, (), "lost before claiming: nothing lands"
        ),
        WireRow(
            "session_lost",
            (_D.CLAIMED, _D.RECEIVING, _D.ABORTING, _D.PEER_ABORTED),
            _D.LOST,
            (),
            "lost after claiming: a peer we cannot hear may still write; the drain deadline decides",
        ),
        WireRow("close", tuple(DecodeWire), None, (), "the room was closed: later frames for it are stale"),
    ),
    "One per decode generation, from bootstrap() to close.",
)

_C = PrefillClaim
CLAIM_TABLE = WireTable(
    "claim",
    PrefillClaim,
    (
        WireRow("recv ROOM: hold", (None,), _C.EARLY, (), "this room id is not bootstrapped here yet: keep the claim"),
        WireRow("recv ROOM: bind", (None,), _C.BOUND, (), "the one open room of that id, unclaimed: bind"),
        WireRow(
            "recv ROOM: refuse",
            (None,),
            _C.ACKED,
            ("ABORT", "ABORT_ACK"),
            "in use, failed, held (orphaned) or ambiguous: refused, nothing was written",
        ),
        WireRow("bind", (_C.EARLY,), _C.BOUND, (), "bootstrap() of the room found this one claim"),
        WireRow("refuse", (_C.EARLY,), _C.ACKED, ("ABORT", "ABORT_ACK"), "bootstrap() found it ambiguous or failed"),
        WireRow(
            "expire", (_C.EARLY,), _C.ACKED, ("ABORT", "ABORT_ACK"), "the room was not bootstrapped within pending_ttl"
        ),
        WireRow("send", (_C.BOUND, _C.WRITING), _C.WRITING, (), "send(): chunks queued for the writer"),
        WireRow("progress", (_C.WRITING,), _C.WRITING, ("CHUNK",), "a middle chunk landed"),
        WireRow(
            "landed", (_C.WRITING,), _C.DONE, ("DONE",), "every write landed and the room succeeded (checked first)"
        ),
        WireRow("fail", (_C.BOUND,), _C.ACKED, ("ABORT", "ABORT_ACK"), "the room failed before any write"),
        WireRow("fail", (_C.WRITING,), _C.STOPPING, ("ABORT",), "the room failed: no new write; drain the others"),
        WireRow("fail", (_C.STOPPING,), _C.STOPPING, (), "our own echo of the decode's ABORT"),
        WireRow("fail", (_C.ACKED,), _C.ACKED, (), "our own echo of the decode's ABORT"),
        WireRow("recv ABORT", (_C.EARLY, _C.BOUND, _C.DONE), _C.ACKED, ("ABORT_ACK",), "nothing is in flight: ACK"),
        WireRow("recv ABORT", (_C.ACKED,), _C.ACKED, ("ABORT_ACK",), "a repeated ABORT: ACK again"),
        WireRow("recv ABORT", (_C.WRITING, _C.STOPPING), _C.STOPPING, (), "writes may be in flight: ACK once drained"),
        WireRow("drained", (_C.STOPPING,), _C.ACKED, ("ABORT_ACK",), "the engine ended every write of the claim"),
        WireRow("session_lost", (_C.EARLY, _C.BOUND, _C.DONE), _C.ACKED, (), "the decode is gone; nothing in flight"),
        WireRow("session_lost", (_C.WRITING, _C.STOPPING), _C.STOPPING, (), "the decode is gone; drain what is left"),
        WireRow("forget", (_C.DONE, _C.ACKED), None, (), "the room is closed and nothing is in flight"),
    ),
    "One per decode claim (session, room, gen); kept until none of its writes is in flight.",
)

_R = PrefillRoom
ROOM_TABLE = WireTable(
    "room",
    PrefillRoom,
    (
        WireRow("bootstrap", (None,), _R.UNCLAIMED, (), "bootstrap(): wait for the decode's claim"),
        WireRow("bootstrap: bind", (None,), _R.CLAIMED, (), "bootstrap(): exactly one early claim was waiting"),
        WireRow(
            "bootstrap: refuse",
            (None, _R.ORPHANED),
            _R.FAILED,
            (),
            "held for an earlier unclaimed generation, aborted early, or claimed twice: fail at once",
        ),
        WireRow("claim", (_R.UNCLAIMED,), _R.CLAIMED, (), "a decode's ROOM bound to this generation"),
        WireRow("fail", (_R.UNCLAIMED,), _R.FAILED, (), "failed before any claim: later ROOMs get this failure"),
        WireRow("close", (_R.FAILED, _R.UNCLAIMED), _R.ORPHANED, (), "closed unclaimed: hold the id for pending_ttl"),
        WireRow("close", (_R.CLAIMED,), None, (), "closed after its claim: the claim record goes on alone"),
        WireRow("expire", (_R.ORPHANED,), None, (), "pending_ttl passed: the id is free again"),
    ),
    "One per room id on the prefill while a generation is open or the id is held.",
)

TABLES: tuple[WireTable, ...] = (DECODE_TABLE, CLAIM_TABLE, ROOM_TABLE)


# -- diagrams -------------------------------------------------------------------------------------


def mermaid(table: WireTable) -> str:
    """A mermaid state diagram of one table, drawn from its rows (the docs' Wire protocol page)."""
    lines = ["stateDiagram-v2", f"    %% kvfsm wire protocol: {table.name} records, generated from kvfsm.backends.wire"]
    for row in table.rows:
        label = row.input + ("" if not row.sends else " / " + ", ".join(row.sends))
        target = "[*]" if row.dest is None else row.dest.name
        for source in row.sources:
            origin = "[*]" if source is None else source.name
            lines.append(f"    {origin} --> {target}: {label}")
    return "\n".join(lines) + "\n"


def sends_table(messages: Iterable[MessageSpec] = MESSAGES) -> list[tuple[str, str, str, str]]:
    """(message, sender, scope, what it does) for the docs."""
    return [(spec.name, spec.sender.value, spec.scope.value, spec.doc) for spec in messages]
