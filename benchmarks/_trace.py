"""Marks along one room's critical path, taken inside kvfsm's own calls (`vs_sglang.py --trace`).

The critical path runs from the prefill's last `send()` to the decode's
scheduler loop seeing `Success`. `install(role)` wraps the few internal
methods that path crosses, in this process only, so that each room gets a
`time.perf_counter()` reading (CLOCK_MONOTONIC: one clock for every process
of the host) at each step; the benchmark's records carry them
(`marks_of(room)`) and `vs_sglang.py` prints the median gap between
consecutive steps. The wrappers only read the time and the room, so what
runs is the production code; they cost a few microseconds a step, which the
trace's own total shows against the untraced critical path.

The steps, in order (`STEPS`):

* prefill: the last `send()` called, and returned; the room's writer lane
  took the chunk; its last write submitted; the lane saw every write
  landed; with completion markers on, the marker submitted (or sent as
  the engine's notification); DONE handed to the socket;
* decode: the control thread took the message in (`admit`); it handled
  DONE; with markers, the control thread found the room's marker (in its
  slot or a notification); the room reached `Success`; the scheduler loop
  saw it. A room that completed on its marker has its DONE steps after
  `Success` (DONE still follows), and they are printed where they fall.

These names are internal and may move: a wrapped method that is gone
fails the traced case (`KeyError` naming it), and
`tests/integration/test_bench_vs_sglang.py` checks that every step is
marked and that the steps add up to the critical path, so the trace cannot
silently go empty.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

#: (step, process) in the order the critical path crosses them.
STEPS: tuple[tuple[str, str], ...] = (
    ("last send() called", "prefill"),
    ("send() returned", "prefill"),
    ("lane took the chunk", "prefill"),
    ("last write submitted", "prefill"),
    ("lane saw every write landed", "prefill"),
    ("commit marker sent", "prefill"),
    ("DONE handed to the socket", "prefill"),
    ("DONE taken in by the control thread", "decode"),
    ("DONE handled", "decode"),
    ("commit marker found", "decode"),
    ("room reached Success", "decode"),
    ("scheduler loop saw Success", "decode"),
)

_marks: dict[Any, dict[str, float]] = {}
_taken_in = threading.local()
_clock = time.perf_counter


def mark(room: Any, step: str, *, first: bool = False) -> None:
    """Note `step` for `room` now; `first` keeps an earlier reading of the same step."""
    marks = _marks.setdefault(room, {})
    if first and step in marks:
        return
    marks[step] = _clock()


def marks_of(room: Any) -> dict[str, float]:
    """The room's marks, forgotten here once read."""
    return _marks.pop(room, {})


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = cls.__dict__[name]  # KeyError: the method moved; the probe test says so
    if isinstance(original, staticmethod):
        setattr(cls, name, staticmethod(functools.wraps(original.__func__)(make(original.__func__))))
    else:
        setattr(cls, name, functools.wraps(original)(make(original)))


def install(role: str) -> None:
    """Wrap the methods on the critical path of `role` ("prefill" or "decode") in this process."""
    if role == "prefill":
        _install_prefill()
    else:
        _install_decode()


def _install_prefill() -> None:
    from kvfsm.backends._remote_sender import PrefillEndpoint
    from kvfsm.backends._remote_writer import Lane

    def send(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, handle: Any, pages: list[int], last: bool, aux_index: int | None) -> None:
            original(self, handle, pages, last, aux_index)
            if last:
                mark(handle.room, "send() returned")

        return traced

    def command(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, command: str, payload: Any) -> None:
            if command == "chunk" and payload[1].last and payload[0].handle is not None:
                mark(payload[0].handle.room, "lane took the chunk")
            original(self, command, payload)

        return traced

    def submit(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, claim: Any, writes: list[Any], **kwargs: Any) -> Any:
            submitted = original(self, claim, writes, **kwargs)
            chunk = self.slice_chunk
            if submitted is not None and chunk is not None and chunk.last and claim.handle is not None:
                mark(claim.handle.room, "last write submitted")
            return submitted

        return traced

    def complete(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, claim: Any, chunk: Any, blob: bytes | None) -> None:
            room = claim.handle.room
            mark(room, "lane saw every write landed")
            original(self, claim, chunk, blob)
            mark(room, "DONE handed to the socket")

        return traced

    def write_marker(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, claim: Any, nbytes: int, chunks: int) -> None:
            original(self, claim, nbytes, chunks)
            if claim.marker is not None:
                mark(claim.handle.room, "commit marker sent")

        return traced

    _wrap(PrefillEndpoint, "send", send)
    _wrap(Lane, "_command", command)
    _wrap(Lane, "_submit", submit)
    _wrap(Lane, "_complete", complete)
    _wrap(Lane, "_write_marker", write_marker)


def _install_decode() -> None:
    from kvfsm.backends._remote_endpoint import RemoteEndpoint
    from kvfsm.backends._remote_receiver import DecodeEndpoint

    def admit(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, frames: list[bytes]) -> Any:
            taken_in = _clock()
            work = original(self, frames)
            if work is None:
                return None

            def handle() -> None:
                _taken_in.at = taken_in
                work()

            return handle

        return traced

    def on_frame(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, session: Any, frame: Any, fire: Any) -> None:
            if frame.type == "DONE":
                rec = session.records.get(frame["gen"])
                if rec is not None:
                    room = rec.handle.room
                    _marks.setdefault(room, {})["DONE taken in by the control thread"] = getattr(
                        _taken_in, "at", _clock()
                    )
                    mark(room, "DONE handled")
            original(self, session, frame, fire)

        return traced

    def progress(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(handle: Any, nbytes: int, *, last: bool) -> None:
            original(handle, nbytes, last=last)
            if last:
                mark(handle.room, "room reached Success", first=True)

        return traced

    def on_marker(original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(self: Any, rec: Any, nbytes: int, chunks: int, fire: Any) -> None:
            mark(rec.handle.room, "commit marker found")
            original(self, rec, nbytes, chunks, fire)

        return traced

    _wrap(RemoteEndpoint, "admit", admit)
    _wrap(DecodeEndpoint, "_on_frame", on_frame)
    _wrap(DecodeEndpoint, "_progress", progress)
    _wrap(DecodeEndpoint, "_on_marker", on_marker)
