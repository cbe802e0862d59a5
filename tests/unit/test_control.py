"""The ZeroMQ transport: bytes in order, housekeeping on its own schedule, bounds (one process).

What the bytes mean is tested in test_wire.py and the remote backend's
tests; here only the carrier: frames arrive in order, a handler that
raises does not end the thread, a flood never starves housekeeping
(issue 11, defect 6), and an oversized message is refused by ZeroMQ
itself before anything is read (defect 7).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")

from kvfsm.backends.control import ControlPlane  # noqa: E402

WAIT = 5.0


class _Inbox:
    def __init__(self, raise_on: bytes = b"explode") -> None:
        self.frames: list[list[bytes]] = []
        self.house: list[float] = []
        self.raise_on = raise_on
        self.lock = threading.Lock()

    def on_frames(self, frames: list[bytes]) -> None:
        if frames and frames[0] == self.raise_on:
            raise RuntimeError("handler bug")
        with self.lock:
            self.frames.append(frames)

    def on_housekeeping(self) -> float:
        self.house.append(time.monotonic())
        return 0.02

    def wait_for(self, predicate: object, timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(predicate) and predicate():
                return True
            time.sleep(0.005)
        return False


@pytest.fixture
def plane() -> Iterator[tuple[ControlPlane, _Inbox]]:
    inbox = _Inbox()
    control = ControlPlane(on_frames=inbox.on_frames, on_housekeeping=inbox.on_housekeeping, max_message_bytes=4096)
    control.start()
    try:
        yield control, inbox
    finally:
        control.stop()


@pytest.fixture
def sender() -> Iterator[ControlPlane]:
    control = ControlPlane(on_frames=lambda frames: None, on_housekeeping=lambda: 1.0)
    try:
        yield control
    finally:
        control.stop()


def test_frames_arrive_in_order_and_a_raising_handler_does_not_end_the_thread(
    plane: tuple[ControlPlane, _Inbox], sender: ControlPlane
) -> None:
    control, inbox = plane
    channel = sender.connect(control.address)
    sender.send(channel, [b"explode"])
    for i in range(50):
        assert sender.send(channel, [b"m", str(i).encode()])
    assert inbox.wait_for(lambda: len(inbox.frames) == 50)
    assert [int(f[1]) for f in inbox.frames] == list(range(50))
    assert control.stats.handler_errors == 1
    assert control.running


def test_housekeeping_keeps_its_schedule_under_a_flood(
    plane: tuple[ControlPlane, _Inbox], sender: ControlPlane
) -> None:
    control, inbox = plane
    channel = sender.connect(control.address)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            for _ in range(200):
                sender.send(channel, [b"garbage" * 50])
            time.sleep(0.001)

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        time.sleep(0.3)
        start = len(inbox.house)
        time.sleep(1.0)
        beats = len(inbox.house) - start
    finally:
        stop.set()
        thread.join()
    # It asks for a turn every 20 ms: a flood may slow it, never stop it.
    assert beats >= 10, f"housekeeping ran {beats} times in 1 s under a flood"
    assert len(inbox.frames) > 100, "the flood did arrive"


def test_an_oversized_message_is_refused_by_zeromq(plane: tuple[ControlPlane, _Inbox], sender: ControlPlane) -> None:
    control, inbox = plane
    big = sender.connect(control.address)
    sender.send(big, [b"x" * 10_000])  # over the 4096-byte limit: ZeroMQ drops the connection
    small = sender.connect(control.address)
    sender.send(small, [b"ok"])
    assert inbox.wait_for(lambda: [b"ok"] in inbox.frames)
    time.sleep(0.1)
    assert all(len(f[0]) < 4096 for f in inbox.frames)


def test_channels_close_and_stop_is_idempotent(sender: ControlPlane) -> None:
    channels = [sender.connect("tcp://127.0.0.1:9") for _ in range(3)]
    assert sender.open_channels == 3
    sender.close_channel(channels[0])
    assert sender.open_channels == 2
    assert not sender.send(channels[0], [b"x"])
    assert sender.stats.send_failures == 1
    sender.stop()
    sender.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        sender.connect("tcp://127.0.0.1:9")
