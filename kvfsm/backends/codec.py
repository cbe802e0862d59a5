"""Frames: how a wire message becomes bytes and back, bounded, and the handshake's MAC.

`wire.py` declares what the protocol says (messages, fields, bounds, the
per-record tables); this module spells it: a message is two or three
ZeroMQ frames (the magic `KVFSM/2`, a JSON header, an optional binary
blob). `encode` builds them for a sender and refuses what would not
validate (a sender bug); `decode` validates what arrives and turns every
way it can be wrong into a `MalformedFrame` naming its counter, never
another exception; `handshake_mac` is the HMAC-SHA256 a shared key puts
on HELLO and HELLO_ACK. Sans-IO like the declaration: no sockets, no zmq.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .wire import CHECK_DOCS, MAGIC, MAX_BLOB_BYTES, MAX_HEADER_BYTES, SPECS

__all__ = ["Frame", "MalformedFrame", "encode", "decode", "handshake_mac"]


class MalformedFrame(ValueError):
    """A frame failed validation; `category` is the counter it goes to, the text says what was wrong."""

    def __init__(self, category: str, problem: str) -> None:
        self.category = category
        super().__init__(problem)


@attrs.frozen(slots=True)
class Frame:
    """One validated message: its type, its fields (header keys) and its blob."""

    type: str
    fields: dict[str, Any]
    blob: bytes | None = None

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def encode(kind: str, fields: Mapping[str, Any], blob: bytes | None = None, *, check: bool = True) -> list[bytes]:
    """The frames of one message. A sender bug (a field that would not validate) raises `MalformedFrame`.

    `check=False` skips the per-field checks (not the size bounds): for the
    endpoints' own frames, built from values they validated when they took
    them in, on the latency path. The test suite's endpoints check every
    frame they send (`RemoteEndpoint.check_frames`).
    """
    spec = SPECS.get(kind)
    if spec is None:
        raise MalformedFrame("unknown_type", f"unknown message type {kind!r}")
    header: dict[str, Any] = {"type": kind}
    if check:
        for name, field_check in spec.fields:
            value = fields.get(name)
            if not field_check(value):
                raise MalformedFrame("malformed", f"{kind}.{name} must be {CHECK_DOCS[field_check]}; got {value!r:.80}")
            header[name] = value
        extra = set(fields) - {name for name, _ in spec.fields}
        if extra:
            raise MalformedFrame("malformed", f"{kind} has no field {sorted(extra)[0]!r}")
    else:
        header.update(fields)
    data = _JSON_OUT.encode(header).encode()
    if len(data) > MAX_HEADER_BYTES:
        raise MalformedFrame("oversized", f"{kind} header is {len(data)} bytes; at most {MAX_HEADER_BYTES}")
    frames = [MAGIC, data]
    if blob is not None:
        if not spec.blob:
            raise MalformedFrame("malformed", f"{kind} carries no blob")
        if len(blob) > MAX_BLOB_BYTES:
            raise MalformedFrame("oversized", f"{kind} blob is {len(blob)} bytes; at most {MAX_BLOB_BYTES}")
        frames.append(bytes(blob))
    return frames


# Built once: json.dumps with separators builds an encoder per call, json.loads on bytes
# guesses the encoding each time (the protocol's is UTF-8).
_JSON_OUT = json.JSONEncoder(separators=(",", ":"))
_JSON_IN = json.JSONDecoder()

# Everything json.loads may raise on hostile bytes: bad JSON or UTF-8 (ValueError and its
# subclasses, including "exceeds the limit for integer string conversion"), too deep a nesting
# (RecursionError), and the rest for safety.
_DECODE_ERRORS = (ValueError, RecursionError, TypeError, OverflowError, MemoryError)


def decode(frames: Sequence[bytes]) -> Frame:
    """Validate the frames of one message; `MalformedFrame` names what is wrong and its counter."""
    if not 2 <= len(frames) <= 3:
        raise MalformedFrame("malformed", f"expected 2 or 3 frames (magic, header[, blob]); got {len(frames)}")
    magic = bytes(frames[0][:32])
    if magic != MAGIC:
        if magic.startswith(b"KVFSM/"):
            raise MalformedFrame("bad_version", f"expected protocol {MAGIC!r}; got {magic!r}")
        raise MalformedFrame("malformed", f"expected magic frame {MAGIC!r}; got {magic!r}")
    if len(frames[1]) > MAX_HEADER_BYTES:
        raise MalformedFrame("oversized", f"header frame of {len(frames[1])} bytes; at most {MAX_HEADER_BYTES}")
    if len(frames) == 3 and len(frames[2]) > MAX_BLOB_BYTES:
        raise MalformedFrame("oversized", f"blob frame of {len(frames[2])} bytes; at most {MAX_BLOB_BYTES}")
    try:
        header = _JSON_IN.decode(str(frames[1], "utf-8"))
    except _DECODE_ERRORS as exc:
        raise MalformedFrame("malformed", f"header frame is not JSON this protocol reads: {exc!s:.120}") from None
    if header.__class__ is not dict:
        raise MalformedFrame("malformed", f"header must be a JSON object; got {type(header).__name__}")
    kind = header.get("type")
    spec = SPECS.get(kind) if kind.__class__ is str else None
    if spec is None:
        raise MalformedFrame("unknown_type", f"unknown message type {kind!r:.40}; known: {', '.join(SPECS)}")
    fields: dict[str, Any] = {}
    for name, check in spec.fields:
        if name not in header:
            raise MalformedFrame("malformed", f"{kind} needs field {name!r} ({CHECK_DOCS[check]}); it is missing")
        value = header[name]
        if not check(value):
            raise MalformedFrame("malformed", f"{kind}.{name} must be {CHECK_DOCS[check]}; got {value!r:.80}")
        fields[name] = value
    if len(header) != len(fields) + 1:
        extra = sorted(set(header) - set(fields) - {"type"})
        raise MalformedFrame("malformed", f"{kind} has unknown field {extra[0]!r:.40}")
    blob = None
    if len(frames) == 3:
        if not spec.blob:
            raise MalformedFrame("malformed", f"{kind} carries no blob; got {len(frames[2])} bytes")
        blob = bytes(frames[2])
    return Frame(str(kind), fields, blob)


def handshake_mac(key: bytes, kind: str, fields: Mapping[str, Any], blob: bytes | None) -> str:
    """HMAC-SHA256 (hex, 64 characters) of a HELLO or HELLO_ACK's content without its `mac`.

    Both sides serialise the same fields the same way (sorted keys, no
    spaces), so the MAC does not depend on the header's byte layout.
    """
    content = {name: value for name, value in fields.items() if name != "mac"}
    data = json.dumps({"type": kind, **content}, sort_keys=True, separators=(",", ":")).encode()
    digest = hmac.new(key, b"KVFSM/2 handshake\0" + data + b"\0" + (blob or b""), hashlib.sha256)
    return digest.hexdigest()
