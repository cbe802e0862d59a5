"""The wire protocol's declaration and codec: tables well formed, frames validated, garbage counted.

The codec must turn every way a frame can be wrong into a `MalformedFrame`
with a counter category and never raise anything else (issue 11, defect 6:
a >4,300-digit integer made `json.loads` raise ValueError, deep nesting
RecursionError, and both escaped the old decoder). And it must be able to
tell what a frame is worth before it parses any JSON (issue 22, defect 8:
valid 6 MiB headers from no session took 0.45 s each to parse): the
envelope is read alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.backends import codec, wire

AUTH = {"sid": "a" * 16, "key": "b" * 32}


def _frames(header: dict[str, Any], blob: bytes | None = None) -> list[bytes]:
    """A message whose envelope holds the header's type, sid and key (as text), the rest its JSON."""
    tokens = [str(header.get(name)) for name in ("type", "sid", "key") if name in header]
    body = {name: value for name, value in header.items() if name not in ("type", "sid", "key")}
    frames = [wire.MAGIC, " ".join(tokens).encode(), json.dumps(body).encode()]
    if blob is not None:
        frames.append(blob)
    return frames


def _room_header(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": "CHUNK", **AUTH, "room": 7, "gen": 11, "pgen": 3, "nbytes": 5}
    base.update(fields)
    return base


def test_round_trip_keeps_fields_and_blob() -> None:
    fields = {**AUTH, "room": 7, "gen": 11, "pgen": 3, "nbytes": 64}
    frame = codec.decode(codec.encode("DONE", fields, b"\x00\x01aux"))
    assert frame == codec.Frame("DONE", fields, b"\x00\x01aux")


@pytest.mark.parametrize(
    ("frames", "category", "needle"),
    [
        ([wire.MAGIC], "malformed", "3 or 4 frames"),
        ([wire.MAGIC, b"HEARTBEAT a b", b"{}", b"", b""], "malformed", "3 or 4 frames"),
        ([b"HTTP/1.1", b"GET", b"{}"], "malformed", "magic"),
        ([b"KVFSM/2", b"{}"], "bad_version", "KVFSM/3"),
        ([wire.MAGIC, b"CHUNK a b", b"{not json"], "malformed", "not JSON"),
        ([wire.MAGIC, b"CHUNK a b", b"\xff\xfe"], "malformed", "not JSON"),
        ([wire.MAGIC, b"CHUNK a b", b"[]"], "malformed", "JSON object"),
        ([wire.MAGIC, b"CHUNK a b", b'{"n": ' + b"1" * 5000 + b"}"], "malformed", "not JSON"),
        ([wire.MAGIC, b"CHUNK a b", b"[" * 100_000 + b"]" * 100_000], "malformed", "not JSON"),
        ([wire.MAGIC, b"CHUNK \xff b", b"{}"], "malformed", "not ASCII"),
        ([wire.MAGIC, b"CHUNK a", b"{}"], "malformed", "session id and secret"),
        ([wire.MAGIC, b"CHUNK a b c", b"{}"], "malformed", "envelope is CHUNK"),
        ([wire.MAGIC, b"HELLO a b", b"{}"], "malformed", "envelope is HELLO"),
        ([wire.MAGIC, b"X" * (wire.MAX_ENVELOPE_BYTES + 1), b"{}"], "oversized", "envelope"),
        ([wire.MAGIC, b"HELLO", b" " * (wire.MAX_HELLO_BYTES + 1)], "oversized", "HELLO header frame"),
        (_frames(_room_header(type="NOPE")), "unknown_type", "NOPE"),
        (_frames(_room_header(type=["CHUNK"])), "unknown_type", "CHUNK"),
        (_frames({k: v for k, v in _room_header().items() if k != "nbytes"}), "malformed", "'nbytes'"),
        (_frames(_room_header(room=True)), "malformed", "CHUNK.room"),
        (_frames(_room_header(room="")), "malformed", "CHUNK.room"),
        (_frames(_room_header(room=1 << 64)), "malformed", "CHUNK.room"),
        (_frames(_room_header(gen=0)), "malformed", "CHUNK.gen"),
        (_frames(_room_header(nbytes=-3)), "malformed", "CHUNK.nbytes"),
        (_frames(_room_header(nbytes=1.5)), "malformed", "CHUNK.nbytes"),
        (_frames(_room_header(key="k" * 65)), "malformed", "envelope is CHUNK"),
        (_frames(_room_header(extra=1)), "malformed", "unknown field 'extra'"),
        (_frames(_room_header(), b"blob"), "malformed", "carries no blob"),
        (
            _frames({"type": "ROOM", **AUTH, "room": 1, "gen": 2, "pages": [1, "2"], "aux": None}),
            "malformed",
            "ROOM.pages",
        ),
        (
            _frames({"type": "ROOM", **AUTH, "room": 1, "gen": 2, "pages": [0] * (wire.MAX_PAGES + 1), "aux": None}),
            "malformed",
            "ROOM.pages",
        ),
        ([wire.MAGIC, b"ROOM a b", b" " * (wire.MAX_HEADER_BYTES + 1)], "oversized", "header frame"),
        ([wire.MAGIC, b"DONE a b", b"{}", b"x" * (wire.MAX_BLOB_BYTES + 1)], "oversized", "blob frame"),
    ],
)
def test_invalid_frames_are_refused_with_a_category_and_a_reason(
    frames: list[bytes], category: str, needle: str
) -> None:
    with pytest.raises(codec.MalformedFrame) as info:
        codec.decode(frames)
    assert info.value.category == category
    assert needle in str(info.value)


def test_encoding_refuses_what_would_not_validate() -> None:
    with pytest.raises(codec.MalformedFrame, match=r"CHUNK\.nbytes"):
        codec.encode("CHUNK", {**AUTH, "room": 1, "gen": 2, "pgen": 0})
    with pytest.raises(codec.MalformedFrame, match="no field 'token'"):
        codec.encode("CHUNK", {**AUTH, "room": 1, "gen": 2, "pgen": 0, "nbytes": 1, "token": "x"})
    with pytest.raises(codec.MalformedFrame, match="unknown message type"):
        codec.encode("FROB", {})
    with pytest.raises(codec.MalformedFrame, match="carries no blob"):
        codec.encode("HEARTBEAT", AUTH, b"x")


def test_unchecked_encoding_is_the_same_bytes_and_keeps_the_bounds() -> None:
    fields = {**AUTH, "room": 1, "gen": 2, "pgen": 0, "nbytes": 4096}
    checked, unchecked = codec.encode("CHUNK", fields), codec.encode("CHUNK", fields, check=False)
    assert codec.decode(unchecked) == codec.decode(checked)
    with pytest.raises(codec.MalformedFrame, match="carries no blob"):
        codec.encode("HEARTBEAT", AUTH, b"x", check=False)
    with pytest.raises(codec.MalformedFrame, match="at most") as info:
        codec.encode("DONE", {**fields, "nbytes": 1}, b"x" * (wire.MAX_BLOB_BYTES + 1), check=False)
    assert info.value.category == "oversized"


@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_bytes_are_only_ever_counted_drops(frames: list[bytes]) -> None:
    category = None
    try:
        codec.decode(frames)
    except codec.MalformedFrame as exc:  # anything else propagates and fails the test
        category = exc.category
    assert category in {None, "malformed", "bad_version", "unknown_type", "oversized"}


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@given(
    kind=st.sampled_from([*wire.SPECS, "NOPE"]),
    fields=st.dictionaries(
        st.sampled_from(["sid", "key", "room", "gen", "pgen", "pages", "aux", "nbytes", "kind", "message", "addr"]),
        _JSON,
        max_size=8,
    ),
    blob=st.none() | st.binary(max_size=16),
)
def test_structured_garbage_is_only_ever_counted_drops(kind: str, fields: dict[str, Any], blob: bytes | None) -> None:
    """Right magic, JSON objects with the right field names and wrong everything else."""
    frames = _frames({"type": kind, **fields}, blob)
    category = frame = None
    try:
        frame = codec.decode(frames)
    except codec.MalformedFrame as exc:  # anything else propagates and fails the test
        category = exc.category
    if frame is None:
        assert category in {"malformed", "unknown_type", "oversized"}  # oversized: a huge sid in the envelope
    else:
        spec = wire.SPECS[frame.type]
        envelope = {"sid", "key"} if spec.authenticated else set()
        envelope |= {"mac"} if spec.handshake else set()
        assert set(frame.fields) == {name for name, _ in spec.fields} | envelope


def test_the_envelope_is_read_without_the_header() -> None:
    """A frame's session is known before a byte of its JSON is parsed, however large or broken that JSON is."""
    huge = b'{"pages": [' + b"1," * (2 << 20) + b"1]}"
    head = codec.envelope([wire.MAGIC, b"ROOM 0000000000000000 ffff", huge])
    assert (head.type, head.sid, head.key, head.mac) == ("ROOM", "0000000000000000", "ffff", None)
    head = codec.envelope([wire.MAGIC, b"ROOM s k", b"[" * 100_000])  # not JSON at all: still no error here
    assert head.type == "ROOM"
    with pytest.raises(codec.MalformedFrame, match="not JSON"):
        codec.decode_body(head, [wire.MAGIC, b"ROOM s k", b"[" * 100_000])


def test_every_row_sends_only_what_its_side_may_send() -> None:
    side = {"decode": wire.Sender.DECODE, "claim": wire.Sender.PREFILL, "room": wire.Sender.PREFILL}
    for table in wire.TABLES:
        for row in table.rows:
            for message in row.sends:
                assert wire.SPECS[message].sender in (side[table.name], wire.Sender.EITHER), (table.name, row)
            if row.input.startswith("recv "):
                received = row.input.removeprefix("recv ").split(":")[0]
                assert wire.SPECS[received].sender is not side[table.name], (table.name, row)


def test_every_state_is_reachable_from_a_new_record() -> None:
    for table in wire.TABLES:
        reached: set[Any] = {None}
        frontier: list[Any] = [None]
        while frontier:
            state = frontier.pop()
            for row in table.rows:
                if state in row.sources and row.dest not in reached:
                    reached.add(row.dest)
                    frontier.append(row.dest)
        assert set(table.states) <= reached, (table.name, set(table.states) - reached)


def test_a_table_refuses_two_rows_for_one_state_and_input() -> None:
    rows = (
        wire.WireRow("x", (None,), wire.DecodeWire.READY, (), ""),
        wire.WireRow("x", (None,), wire.DecodeWire.DONE, (), ""),
    )
    with pytest.raises(ValueError, match="two rows for 'x'"):
        wire.WireTable("bad", wire.DecodeWire, rows, "")


_HELLO = {
    "addr": "tcp://127.0.0.1:1",
    "reply_sid": "s",
    "reply_key": "t",
    "role": "receiver",
    "engine": "e",
    "session": {},
}


def test_the_handshake_mac_covers_every_byte_and_is_checked_before_parsing() -> None:
    key = b"k" * 32
    frames = codec.encode("HELLO", _HELLO, b"meta", mac_key=key)
    head = codec.envelope(frames)
    assert head.mac is not None and len(head.mac) == 64
    assert head.mac == codec.handshake_mac(key, frames)
    assert codec.verify_mac(key, head, frames)
    assert not codec.verify_mac(b"x" * 32, head, frames)
    for tampered in (
        [*frames[:2], frames[2].replace(b"127.0.0.1:1", b"127.0.0.1:2"), frames[3]],
        [*frames[:3], b"other"],
        frames[:3],
    ):
        assert not codec.verify_mac(key, codec.envelope(tampered), tampered), tampered
    unsigned = codec.encode("HELLO", _HELLO, b"meta")
    assert not codec.verify_mac(key, codec.envelope(unsigned), unsigned)
    reply = {name: value for name, value in _HELLO.items() if name != "addr"}
    ack = codec.encode("HELLO_ACK", {**AUTH, **reply, "refused": ""}, b"meta", mac_key=key)
    assert codec.handshake_mac(key, ack) != codec.handshake_mac(key, frames)


def test_mermaid_draws_every_row() -> None:
    text = wire.mermaid(wire.CLAIM_TABLE)
    assert text.startswith("stateDiagram-v2")
    for row in wire.CLAIM_TABLE.rows:
        assert row.input in text
