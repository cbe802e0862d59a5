"""The ZeroMQ control plane: framing, validation, delivery, liveness (one process)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")

from kvfsm.backends.control import (  # noqa: E402
    MAGIC,
    ControlMessage,
    ControlPlane,
    MalformedMessage,
    decode_frames,
    encode_message,
)

WAIT = 5.0


def _header(**fields: object) -> bytes:
    base: dict[str, object] = {"type": "CHUNK", "from": "abc", "addr": "tcp://127.0.0.1:1"}
    base.update(fields)
    return json.dumps(base).encode()


def test_round_trip_keeps_fields_and_blob() -> None:
    frames = encode_message(
        "ROOM", "me", "tcp://127.0.0.1:5", {"room": 7, "token": "t", "pages": [1, 2], "aux": None}, b"\x00\x01"
    )
    message = decode_frames(frames)
    assert message == ControlMessage(
        "ROOM", "me", "tcp://127.0.0.1:5", {"room": 7, "token": "t", "pages": [1, 2], "aux": None}, b"\x00\x01"
    )


@pytest.mark.parametrize(
    ("frames", "category", "needle"),
    [
        ([MAGIC], "malformed", "2 or 3 frames"),
        ([b"HTTP/1.1", b"{}"], "malformed", "magic"),
        ([b"KVFSM/2", b"{}"], "bad_version", "KVFSM/1"),
        ([MAGIC, b"{not json"], "malformed", "not JSON"),
        ([MAGIC, b"[]"], "malformed", "JSON object"),
        ([MAGIC, _header(type="NOPE")], "unknown_type", "NOPE"),
        ([MAGIC, _header(room=1, token="t", nbytes=3)], "malformed", "'last'"),
        ([MAGIC, _header(room=True, token="t", nbytes=3, last=False)], "malformed", "CHUNK.room"),
        ([MAGIC, _header(room=1, token="t", nbytes=-3, last=False)], "malformed", "CHUNK.nbytes"),
        ([MAGIC, _header(**{"from": 5}, room=1, token="t", nbytes=3, last=False)], "malformed", "'from'"),
        (
            [MAGIC, _header(type="ROOM", room=1, token="t", pages=[1, "2"], aux=None)],
            "malformed",
            "ROOM.pages",
        ),
    ],
)
def test_invalid_frames_are_rejected_with_a_reason(frames: list[bytes], category: str, needle: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode_frames(frames)
    assert info.value.category == category
    assert needle in str(info.value)


def test_encoding_refuses_what_would_not_validate() -> None:
    with pytest.raises(MalformedMessage):
        encode_message("CHUNK", "me", "tcp://127.0.0.1:5", {"room": 1})


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[ControlMessage] = []
        self.lost: list[tuple[str, str | None, str]] = []
        self.event = threading.Event()

    def on_message(self, message: ControlMessage) -> None:
        if message.type == "ABORT" and message["message"] == "explode":
            raise RuntimeError("handler bug")
        self.messages.append(message)
        self.event.set()

    def on_lost(self, addr: str, peer_id: str | None, why: str) -> None:
        self.lost.append((addr, peer_id, why))
        self.event.set()

    def wait_for(self, predicate: object, timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(predicate) and predicate():
                return True
            time.sleep(0.005)
        return False


@pytest.fixture
def planes() -> Iterator[tuple[ControlPlane, _Inbox, ControlPlane, _Inbox]]:
    inbox_a, inbox_b = _Inbox(), _Inbox()
    a = ControlPlane(on_message=inbox_a.on_message, on_peer_lost=inbox_a.on_lost, heartbeat_interval=0.05)
    b = ControlPlane(on_message=inbox_b.on_message, on_peer_lost=inbox_b.on_lost, heartbeat_interval=0.05)
    a.start()
    b.start()
    try:
        yield a, inbox_a, b, inbox_b
    finally:
        a.stop()
        b.stop()


def test_messages_arrive_in_order_and_bad_ones_never_reach_the_handler(
    planes: tuple[ControlPlane, _Inbox, ControlPlane, _Inbox],
) -> None:
    a, _, b, inbox_b = planes
    abort = {"room": 3, "token": None, "kind": "aborted", "message": "bye"}
    a.send_raw(b.address, [b"garbage"])
    a.send_raw(b.address, [b"KVFSM/0", b"{}"])
    a.send_raw(b.address, [MAGIC, _header(type="WHAT")])
    a.send(b.address, "ABORT", {**abort, "message": "explode"})  # the handler raises
    for i in range(5):
        a.send(b.address, "CHUNK", {"room": 3, "token": "t", "nbytes": i, "last": False})
    a.send(b.address, "ABORT", abort)
    assert inbox_b.wait_for(lambda: len(inbox_b.messages) == 6)
    assert [m["nbytes"] for m in inbox_b.messages[:5]] == [0, 1, 2, 3, 4]
    assert inbox_b.messages[5].type == "ABORT"
    assert all(m.sender == a.endpoint_id and m.addr == a.address for m in inbox_b.messages)
    stats = b.stats
    assert (stats.malformed, stats.bad_version, stats.unknown_type, stats.handler_errors) == (1, 1, 1, 1)
    assert b.running, "a bad message or a failing handler must not end the control thread"


def test_silent_peer_is_lost_once_within_the_window(planes: tuple[ControlPlane, _Inbox, ControlPlane, _Inbox]) -> None:
    a, inbox_a, b, _ = planes
    a.watch(b.address)
    b.watch(a.address)
    time.sleep(0.3)  # heartbeats keep both alive well past the 0.15 s window
    assert inbox_a.lost == []
    b.stop(say_bye=False)  # b goes silent, as a killed process would
    started = time.monotonic()
    assert inbox_a.wait_for(lambda: inbox_a.lost)
    elapsed = time.monotonic() - started
    assert elapsed < 0.15 + 2.0
    time.sleep(0.2)
    assert len(inbox_a.lost) == 1
    addr, _peer_id, why = inbox_a.lost[0]
    assert addr == b.address
    assert "no message" in why


def test_bye_reports_the_peer_at_once(planes: tuple[ControlPlane, _Inbox, ControlPlane, _Inbox]) -> None:
    a, inbox_a, b, _ = planes
    a.watch(b.address)
    b.watch(a.address)
    assert inbox_a.wait_for(lambda: a.peer_id(b.address) == b.endpoint_id)
    b.stop()
    assert inbox_a.wait_for(lambda: inbox_a.lost)
    assert "BYE" in inbox_a.lost[0][2]


def test_watching_nobody_sends_no_heartbeat(planes: tuple[ControlPlane, _Inbox, ControlPlane, _Inbox]) -> None:
    a, _, _b, _ = planes
    time.sleep(0.2)
    assert a.stats.heartbeats_sent == 0


def test_invalid_settings_are_refused() -> None:
    def ignore(*_: object) -> None:
        return None

    with pytest.raises(ValueError, match="heartbeat_interval"):
        ControlPlane(on_message=ignore, on_peer_lost=ignore, heartbeat_interval=0)
    with pytest.raises(ValueError, match="heartbeat_misses"):
        ControlPlane(on_message=ignore, on_peer_lost=ignore, heartbeat_misses=0)
