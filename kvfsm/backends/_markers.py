"""Completion on the data plane: the commit markers a prefill writes into its decode's memory.

Over the control plane a room completes when the prefill's DONE has crossed
ZeroMQ and been handled: two thread hand-offs and a round trip that sit on
every request's time to first token (issue 23 traced them at about 300 us of
a one-page room's 900). So a decode that can also hears it on the data plane:

* it registers a small region of marker slots with its engine (one slot of
  `MARKER_BYTES` per room it claims) and names the region in its HELLO;
* its claim (ROOM) names a slot and a fresh random token for that room;
* once every write of the room completed, and only then (rule 14: a failed
  write is never followed by a marker), the prefill writes the token, the
  room's byte count and its chunk count into that slot, from a slot of its
  own registered region;
* the decode's control thread reads its claimed rooms' slots while any is
  claimed; the token it minted, found there, proves every byte landed, and
  the room succeeds without waiting for DONE.

An engine that the decode must poll for its incoming writes to progress
(NIXL without its progress thread) would not move a marker along once the
room's own writes ended, so there the marker travels as the engine's
notification instead (`EngineAdapter.notifies`): the decode names
`notify` in its HELLO, and the prefill, at the same point and under the
same rule, sends the slot's 24 bytes as a notification (`notification`)
on the engine's endpoint to the decode, which its control thread reads
while polling the engine anyway and checks as it would the slot
(`parse_notification`; the token, and the prefill's engine id).

DONE still goes out as before and completes the room if the marker could
not be written (no slot free on either side, the marker write failed). A
DONE or CHUNK arriving after the marker is expected, not stale. Nothing
but a token equal to the one the decode minted counts, so a slot is reused
freely: a late marker of an earlier room carries that room's token and
proves nothing for the next. This module holds the slots and the checks
of what a peer says of its region; the halves that use them are
`_remote_receiver` (reads) and `_remote_writer` (writes).
"""

from __future__ import annotations

import ctypes
import secrets
import struct
import threading
from typing import Any

from .memory import MemoryRegion
from .wire import MAX_MARKER_SLOTS, MAX_TOKEN

__all__ = [
    "MARKER_BYTES",
    "MarkerSlots",
    "markers_from_fields",
    "new_token",
    "notification",
    "parse_notification",
]

#: One marker: the room's token, the bytes the prefill wrote for it and its chunks (uint64 each).
MARKER_BYTES = 24
_WORDS = MARKER_BYTES // 8
#: A marker sent as an engine notification: this prefix, then the slot's three words (little-endian).
_NOTE_PREFIX = b"kvfsm-marker\0"
_NOTE = struct.Struct("<QQQ")
NOTE_BYTES = len(_NOTE_PREFIX) + _NOTE.size


def notification(token: int, nbytes: int, chunks: int) -> bytes:
    """A room's commit marker as an engine notification."""
    return _NOTE_PREFIX + _NOTE.pack(token, nbytes, chunks)


def parse_notification(message: bytes) -> tuple[int, int, int] | None:
    """(token, bytes, chunks) of a notification, or None when it is not a well-formed marker."""
    if len(message) != NOTE_BYTES or not message.startswith(_NOTE_PREFIX):
        return None
    token, nbytes, chunks = _NOTE.unpack_from(message, len(_NOTE_PREFIX))
    if not 0 < token <= MAX_TOKEN:
        return None
    return token, nbytes, chunks


def new_token() -> int:
    """A fresh room token: random, never 0."""
    return secrets.randbelow(MAX_TOKEN) + 1


class MarkerSlots:
    """A host buffer of marker slots, the engine-registered region over it, and which slots are free."""

    def __init__(self, slots: int) -> None:
        if not 0 < slots <= MAX_MARKER_SLOTS:
            raise ValueError(f"marker slots must be 1..{MAX_MARKER_SLOTS}; got {slots}")
        self.slots = slots
        # Aligned uint64 words, each read and written whole: token, bytes, chunks.
        self._words = (ctypes.c_uint64 * (_WORDS * slots))()
        self.ptr = ctypes.addressof(self._words)
        self.region = MemoryRegion(self.ptr, slots * MARKER_BYTES, MARKER_BYTES, device="cpu", name="markers")
        self._free = list(range(slots - 1, -1, -1))
        # The prefill's lanes take and give source slots from threads of their own.
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """A free slot, emptied; None when every slot is taken."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self._words[_WORDS * slot] = 0
        return slot

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def address(self, slot: int) -> int:
        return self.ptr + slot * MARKER_BYTES

    def write(self, slot: int, token: int, nbytes: int, chunks: int) -> None:
        base = _WORDS * slot
        self._words[base] = token
        self._words[base + 1] = nbytes
        self._words[base + 2] = chunks

    def holds(self, slot: int, token: int) -> bool:
        """Whether `token` is in the slot (the proof a decode waits for)."""
        return bool(self._words[_WORDS * slot] == token)

    def counts(self, slot: int) -> tuple[int, int]:
        """The byte and chunk counts beside the token (read once it matched; progress accounting only)."""
        base = _WORDS * slot
        return int(self._words[base + 1]), int(self._words[base + 2])


def markers_from_fields(value: Any) -> tuple[int, int] | None:
    """A peer's marker region (`[ptr, slots]` in its session fields), or None when it names none.

    Raises TypeError for a value that is there but is not a region.
    """
    if value is None:
        return None
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(item.__class__ is int for item in value)
        and value[0] > 0
        and 0 < value[1] <= MAX_MARKER_SLOTS
    ):
        raise TypeError(f"session.markers must be [ptr, slots] (1..{MAX_MARKER_SLOTS} slots); got {value!r:.80}")
    return value[0], value[1]
