"""Room ids for the ids a server's clients choose: any of them, mapped to one every manager takes.

A kvfsm room id is an int of 64 bits or a string of 1 to
`kvfsm.MAX_ROOM_ID_CHARS` characters (what the wire carries). The servers'
own ids are not: vLLM takes request ids from its clients, of any length,
and SGLang's `bootstrap_room` is any Python int (SGLang's classes take
2**64 and -2**63-1). A compat layer maps such an id here before it opens a
room (issue 22, item 4), and both processes of a transfer map it the same
way, so they still meet in one room:

* an id that fits, and cannot be mistaken for a mapped one, is itself;
* an int beyond 64 bits becomes the string ``~int:<hex>``;
* a string that does not fit, or starts with ``~``, becomes ``~sha256:``
  and the SHA-256 of its UTF-8 bytes (64 hex digits).

The three forms cannot meet: a string kept as it is never starts with
``~``. Two ids share a room only through a SHA-256 collision; where two
live requests meet on one endpoint that is refused like any duplicate room
(`kvfsm.DuplicateRoom`), failing the newcomer alone, and across processes
it is as likely as a SHA-256 collision (about 2**-128 for a pair).
"""

from __future__ import annotations

import hashlib
from typing import Any

from .._states import MAX_INT_ROOM_ID, MAX_ROOM_ID_CHARS, MIN_INT_ROOM_ID

__all__ = ["MAPPED_PREFIX", "fit_room_id", "fit_text", "room_text"]

#: What every mapped id starts with (an id kept as it is never does).
MAPPED_PREFIX = "~"
_DIGEST = "~sha256:"
_INT = "~int:"


def fit_text(key: str) -> str:
    """A string room id for `key`: `key` itself when it fits (and does not start with ``~``), else its digest."""
    if 0 < len(key) <= MAX_ROOM_ID_CHARS and not key.startswith(MAPPED_PREFIX):
        return key
    # surrogatepass: a client's JSON may carry lone surrogates, which plain UTF-8 refuses to encode.
    return _DIGEST + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def fit_room_id(room: Any) -> Any:
    """The room id for `room`: ints and strings always fit after this; anything else comes back as it is.

    (A value of another type is the caller's to refuse: the manager raises
    `kvfsm.InvalidRoomId` for it, as before.)
    """
    if room.__class__ is int:
        assert isinstance(room, int)
        if MIN_INT_ROOM_ID <= room <= MAX_INT_ROOM_ID:
            return room
        return fit_text(_INT + format(room, "x"))  # hex: decimal refuses ints over 4300 digits
    if room.__class__ is str:
        assert isinstance(room, str)
        return fit_text(room)
    return room


def room_text(room: object, most: int = 64) -> str:
    """A short text naming `room` for ids built from it (any int, however large; at most `most` characters)."""
    if isinstance(room, int) and not isinstance(room, bool):
        text = str(room) if abs(room) < 10**60 else f"0x{room:x}"
    else:
        text = repr(room)
    return text if len(text) <= most else f"{text[: most - 12]}...{len(text)}ch"
