"""Frames: how a wire message becomes bytes and back, bounded, and the handshake's MAC.

`wire.py` declares what the protocol says (messages, fields, bounds, the
per-record tables); this module spells it. A message is three or four
ZeroMQ frames:

    magic       b"KVFSM/3"
    envelope    b"TYPE [sid key] [mac]": ASCII, at most wire.MAX_ENVELOPE_BYTES
    header      a JSON object: the message's fields
    blob        optional binary (engine metadata in a handshake, aux bytes in DONE)

The envelope comes first so that an endpoint can decide what a frame is
worth before it parses any JSON: `envelope()` reads only the magic, the
envelope and the frames' sizes, so a frame that names no session is
dropped for the price of a dictionary lookup, and a handshake's MAC is
checked over the raw bytes (`verify_mac`) before its header is read.
`decode_body()` then parses and validates the header; `decode()` does
both. `encode` builds the frames for a sender and refuses what would not
validate (a sender bug). Every way a frame can be wrong becomes a
`MalformedFrame` naming its counter, never another exception. Sans-IO
like the declaration: no sockets, no zmq.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .wire import CHECK_DOCS, MAGIC, MAX_BLOB_BYTES, MAX_ENVELOPE_BYTES, SPECS, MessageSpec, token_ok

__all__ = [
    "Envelope",
    "Frame",
    "MalformedFrame",
    "decode",
    "decode_body",
    "encode",
    "envelope",
    "handshake_mac",
    "verify_mac",
]

#: What every MAC is computed over first: the protocol, so a MAC of one version never passes in another.
_MAC_DOMAIN = MAGIC + b" handshake\0"


class MalformedFrame(ValueError):
    """A frame failed validation; `category` is the counter it goes to, the text says what was wrong."""

    def __init__(self, category: str, problem: str) -> None:
        self.category = category
        super().__init__(problem)


@attrs.frozen(slots=True)
class Envelope:
    """What a message says about itself before its header is parsed: type, session id and secret, MAC."""

    type: str
    spec: MessageSpec
    sid: str | None = None
    key: str | None = None
    mac: str | None = None


@attrs.frozen(slots=True)
class Frame:
    """One validated message: its type, its fields (the envelope's `sid`, `key`, `mac` too) and its blob."""

    type: str
    fields: dict[str, Any]
    blob: bytes | None = None

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def _envelope_bytes(kind: str, sid: str | None, key: str | None, mac: str | None) -> bytes:
    tokens = [kind]
    if sid is not None and key is not None:
        tokens += [sid, key]
    if mac is not None:
        tokens.append(mac)
    return " ".join(tokens).encode("ascii")


def encode(
    kind: str,
    fields: Mapping[str, Any],
    blob: bytes | None = None,
    *,
    check: bool = True,
    mac_key: bytes | None = None,
) -> list[bytes]:
    """The frames of one message. A sender bug (a field that would not validate) raises `MalformedFrame`.

    `fields` holds the header's fields and, for every message but HELLO,
    the receiver's `sid` and `key`, which go into the envelope; with
    `mac_key` a handshake message gets its MAC. `check=False` skips the
    per-field checks (not the size bounds): for the endpoints' own frames,
    built from values they validated when they took them in, on the
    latency path. The test suite's endpoints check every frame they send
    (`RemoteEndpoint.check_frames`).
    """
    spec = SPECS.get(kind)
    if spec is None:
        raise MalformedFrame("unknown_type", f"unknown message type {kind!r}")
    sid = key = None
    if spec.authenticated:
        sid, key = fields.get("sid"), fields.get("key")
        if not (token_ok(sid) and token_ok(key)):
            raise MalformedFrame("malformed", f"{kind} needs the receiver's sid and key; got {sid!r:.80}, {key!r:.80}")
    header: dict[str, Any] = {}
    if check:
        for name, field_check in spec.fields:
            value = fields.get(name)
            if not field_check(value):
                raise MalformedFrame("malformed", f"{kind}.{name} must be {CHECK_DOCS[field_check]}; got {value!r:.80}")
            header[name] = value
        extra = set(fields) - {name for name, _ in spec.fields} - {"sid", "key", "mac"}
        if extra:
            raise MalformedFrame("malformed", f"{kind} has no field {sorted(extra)[0]!r}")
    else:
        header.update((name, value) for name, value in fields.items() if name not in ("sid", "key", "mac"))
    data = _JSON_OUT.encode(header).encode()
    if len(data) > spec.max_header:
        raise MalformedFrame("oversized", f"{kind} header is {len(data)} bytes; at most {spec.max_header}")
    if blob is not None:
        if not spec.blob:
            raise MalformedFrame("malformed", f"{kind} carries no blob")
        if len(blob) > MAX_BLOB_BYTES:
            raise MalformedFrame("oversized", f"{kind} blob is {len(blob)} bytes; at most {MAX_BLOB_BYTES}")
        blob = bytes(blob)
    mac = None
    if mac_key is not None and spec.handshake:
        mac = _mac(mac_key, _envelope_bytes(kind, sid, key, None), data, blob)
    frames = [MAGIC, _envelope_bytes(kind, sid, key, mac), data]
    if blob is not None:
        frames.append(blob)
    return frames


# Built once: json.dumps with separators builds an encoder per call, json.loads on bytes
# guesses the encoding each time (the protocol's is UTF-8).
_JSON_OUT = json.JSONEncoder(separators=(",", ":"))
_JSON_IN = json.JSONDecoder()

# Everything json.loads may raise on hostile bytes: bad JSON or UTF-8 (ValueError and its
# subclasses, including "exceeds the limit for integer string conversion"), too deep a nesting
# (RecursionError), and the rest for safety.
_DECODE_ERRORS = (ValueError, RecursionError, TypeError, OverflowError, MemoryError)


def envelope(frames: Sequence[bytes]) -> Envelope:
    """Read a message's magic, envelope and frame sizes, and nothing of its header.

    Cheap whatever the frames hold (no JSON is parsed), so it runs on every
    frame that arrives; `MalformedFrame` names what is wrong and its counter.
    """
    magic = bytes(frames[0][:32]) if frames else b""
    if magic != MAGIC:
        if magic.startswith(b"KVFSM/"):
            raise MalformedFrame("bad_version", f"expected protocol {MAGIC!r}; got {magic!r}")
        raise MalformedFrame("malformed", f"expected magic frame {MAGIC!r}; got {magic!r}")
    if not 3 <= len(frames) <= 4:
        raise MalformedFrame(
            "malformed", f"expected 3 or 4 frames (magic, envelope, header[, blob]); got {len(frames)}"
        )
    raw = frames[1]
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise MalformedFrame("oversized", f"envelope of {len(raw)} bytes; at most {MAX_ENVELOPE_BYTES}")
    try:
        tokens = bytes(raw).decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise MalformedFrame("malformed", "the envelope is not ASCII") from None
    kind = tokens[0]
    spec = SPECS.get(kind)
    if spec is None:
        raise MalformedFrame("unknown_type", f"unknown message type {kind!r:.40}; known: {', '.join(SPECS)}")
    rest = tokens[1:]
    sid = key = mac = None
    if spec.authenticated:
        if len(rest) < 2:
            raise MalformedFrame("malformed", f"a {kind} envelope needs the session id and secret")
        sid, key, rest = rest[0], rest[1], rest[2:]
    if spec.handshake and rest:
        mac, rest = rest[0], rest[1:]
    if rest or not all(token_ok(t) for t in (sid, key, mac) if t is not None):
        raise MalformedFrame("malformed", f"a {kind} envelope is {kind} {'[sid key] ' * spec.authenticated}[mac]")
    if len(frames[2]) > spec.max_header:
        raise MalformedFrame("oversized", f"{kind} header frame of {len(frames[2])} bytes; at most {spec.max_header}")
    if len(frames) == 4:
        if not spec.blob:
            raise MalformedFrame("malformed", f"{kind} carries no blob; got {len(frames[3])} bytes")
        if len(frames[3]) > MAX_BLOB_BYTES:
            raise MalformedFrame("oversized", f"blob frame of {len(frames[3])} bytes; at most {MAX_BLOB_BYTES}")
    return Envelope(kind, spec, sid, key, mac)


def decode_body(head: Envelope, frames: Sequence[bytes]) -> Frame:
    """Parse and validate the header of a message whose envelope `head` was read from `frames`."""
    kind, spec = head.type, head.spec
    try:
        header = _JSON_IN.decode(str(frames[2], "utf-8"))
    except _DECODE_ERRORS as exc:
        raise MalformedFrame("malformed", f"header frame is not JSON this protocol reads: {exc!s:.120}") from None
    if header.__class__ is not dict:
        raise MalformedFrame("malformed", f"header must be a JSON object; got {type(header).__name__}")
    fields: dict[str, Any] = {}
    for name, check in spec.fields:
        if name not in header:
            raise MalformedFrame("malformed", f"{kind} needs field {name!r} ({CHECK_DOCS[check]}); it is missing")
        value = header[name]
        if not check(value):
            raise MalformedFrame("malformed", f"{kind}.{name} must be {CHECK_DOCS[check]}; got {value!r:.80}")
        fields[name] = value
    if len(header) != len(fields):
        extra = sorted(set(header) - set(fields))
        raise MalformedFrame("malformed", f"{kind} has unknown field {extra[0]!r:.40}")
    if spec.authenticated:
        fields["sid"], fields["key"] = head.sid, head.key
    if spec.handshake:
        fields["mac"] = head.mac
    blob = bytes(frames[3]) if len(frames) == 4 else None
    return Frame(kind, fields, blob)


def decode(frames: Sequence[bytes]) -> Frame:
    """Validate the frames of one message; `MalformedFrame` names what is wrong and its counter."""
    return decode_body(envelope(frames), frames)


def _mac(key: bytes, envelope_without_mac: bytes, header: bytes, blob: bytes | None) -> str:
    parts = (_MAC_DOMAIN, envelope_without_mac, b"\0", header, b"\0", blob or b"")
    digest = hmac.new(key, b"".join(parts), hashlib.sha256)
    return digest.hexdigest()


def handshake_mac(key: bytes, frames: Sequence[bytes]) -> str:
    """HMAC-SHA256 (hex, 64 characters) of a HELLO or HELLO_ACK's bytes, its own MAC left out.

    Computed over the envelope without the MAC, the header's bytes as sent
    and the blob, so it does not depend on how either side serialises JSON.
    """
    head = envelope(frames)
    blob = bytes(frames[3]) if len(frames) == 4 else None
    return _mac(key, _envelope_bytes(head.type, head.sid, head.key, None), bytes(frames[2]), blob)


def verify_mac(key: bytes, head: Envelope, frames: Sequence[bytes]) -> bool:
    """Whether a handshake message carries the right MAC of `key` (constant time; no JSON parsed)."""
    if head.mac is None:
        return False
    blob = bytes(frames[3]) if len(frames) == 4 else None
    expected = _mac(key, _envelope_bytes(head.type, head.sid, head.key, None), bytes(frames[2]), blob)
    return hmac.compare_digest(head.mac, expected)
