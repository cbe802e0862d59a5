"""The ZeroMQ transport between a prefill and a decode process: bytes in, bytes out, one thread.

What the bytes mean is declared in `kvfsm.backends.wire`; who may say what
is decided by the endpoint (`kvfsm.backends.remote`). This module only
carries frames, as SGLang's Mooncake connector does: every endpoint binds
one PULL socket at its `address`, and opens one PUSH socket ("channel") per
session it holds, so the sockets it opens are bounded by its sessions.

One thread per endpoint receives, and on its own schedule runs the
endpoint's housekeeping (heartbeats, liveness, expiries, engine polling),
so a stream of frames, valid or not, can never keep heartbeats from going
out or being checked:

* the PULL socket refuses messages larger than `max_message_bytes`
  (ZeroMQ's MAXMSGSIZE disconnects the peer that sends one) and queues at
  most `receive_queue` of them per connection;
* each loop turn handles at most `frames_per_turn` frames and ends early
  when housekeeping is due;
* ZeroMQ serves its connections fairly, so one flooding connection delays
  another's frames by a bounded share, not indefinitely;
* a frame whose handling raises is counted in `ControlStats.handler_errors`
  and the thread goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import zmq

from . import wire
from ._naps import precise_naps
from ._transport import ControlStats

__all__ = ["Channel", "ControlPlane", "ControlStats"]

logger = logging.getLogger("kvfsm.backends.control")


class Channel:
    """One PUSH socket to one peer address (one per session)."""

    __slots__ = ("addr", "closed", "lock", "socket")

    def __init__(self, addr: str, socket: zmq.Socket[bytes]) -> None:
        self.addr = addr
        self.socket = socket
        self.lock = threading.Lock()
        self.closed = False


class ControlPlane:
    """A bound PULL socket, PUSH channels, and the thread that serves them.

    `on_frames(frames)` runs on the thread for every message received.
    `on_housekeeping()` runs at least every `tick` seconds whatever
    arrives, and returns when it wants to run next (seconds from now).
    The thread keeps its own time (`clock`, real time by default); the
    endpoint reads whatever clock it keeps inside its housekeeping.
    """

    def __init__(
        self,
        *,
        on_frames: Callable[[list[bytes]], None],
        on_housekeeping: Callable[[], float],
        host: str = "127.0.0.1",
        port: int = 0,
        tick: float = 0.05,
        frames_per_turn: int = 64,
        max_message_bytes: int = wire.MAX_HEADER_BYTES + 4096,
        receive_queue: int = 1000,
        name: str = "kvfsm",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats = ControlStats()
        self._on_frames = on_frames
        self._on_housekeeping = on_housekeeping
        self._tick = float(tick)
        self._frames_per_turn = frames_per_turn
        self._clock = clock
        self._name = name
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._pull.setsockopt(zmq.RCVHWM, receive_queue)
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # A wake-up line into the thread's poll: `wake()` makes housekeeping run now.
        self._wake_address = f"inproc://kvfsm-wake-{id(self):x}"
        self._wake_in = self._ctx.socket(zmq.PULL)
        self._wake_in.setsockopt(zmq.LINGER, 0)
        self._wake_in.bind(self._wake_address)
        self._wake_out = self._ctx.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(self._wake_address)
        self._wake_lock = threading.Lock()
        self._channels: set[Channel] = set()
        self._channels_lock = threading.Lock()
        self._raw: dict[str, Channel] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-control", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._channels_lock:
            channels = list(self._channels)
            self._channels.clear()
        for channel in channels:
            self._close_socket(channel)
        with self._wake_lock:
            self._wake_out.close(linger=0)
        self._wake_in.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    # -- channels ------------------------------------------------------------------------

    def connect(self, addr: str) -> Channel:
        """A new channel to `addr` (ZeroMQ connects in the background)."""
        with self._channels_lock:
            if self._stop.is_set():
                raise RuntimeError(f"control plane {self.address} is stopped")
            socket = self._ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 10000)
            socket.connect(addr)
            channel = Channel(addr, socket)
            self._channels.add(channel)
        return channel

    def close_channel(self, channel: Channel) -> None:
        with self._channels_lock:
            self._channels.discard(channel)
        self._close_socket(channel)

    @staticmethod
    def _close_socket(channel: Channel) -> None:
        with channel.lock:
            if not channel.closed:
                channel.closed = True
                channel.socket.close(linger=0)

    def send(self, channel: Channel, frames: list[bytes]) -> bool:
        """Queue one message without blocking; False (and counted) if it could not be queued."""
        try:
            with channel.lock:
                if channel.closed:
                    raise RuntimeError("the channel is closed")
                channel.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except (zmq.ZMQError, RuntimeError) as exc:
            self.stats.send_failures += 1
            logger.warning("%s: could not send to %s: %s", self._name, channel.addr, exc)
            return False
        self.stats.sent += 1
        return True

    def wake(self) -> None:
        """Run housekeeping at once (from any thread), e.g. when an engine now needs polling."""
        with self._wake_lock:
            if not self._stop.is_set():
                with contextlib.suppress(zmq.ZMQError):  # a wake-up is already queued
                    self._wake_out.send(b"", flags=zmq.NOBLOCK)

    def send_raw(self, addr: str, frames: list[bytes]) -> None:
        """Send arbitrary frames to `addr` (tests use it to play a hostile peer)."""
        channel = self._raw.get(addr)
        if channel is None:
            channel = self._raw[addr] = self.connect(addr)
        with channel.lock:
            channel.socket.send_multipart(frames, flags=zmq.NOBLOCK)

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        precise_naps()  # a sub-millisecond turn below naps with time.sleep
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        next_house = self._clock()
        while not self._stop.is_set():
            try:
                now = self._clock()
                if now >= next_house:
                    next_house = now + min(self._tick, max(0.0, self._housekeeping()))
                wait = next_house - self._clock()
                if wait >= 0.001:
                    ready = dict(poller.poll(int(wait * 1000)))
                else:
                    # A sub-millisecond turn (an engine that wants polling): ZeroMQ's timeout is
                    # in whole milliseconds, so look, and nap only if nothing came.
                    ready = dict(poller.poll(0))
                    if not ready and wait > 0:
                        time.sleep(wait)
                if self._wake_in in ready:
                    while True:
                        try:
                            self._wake_in.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    next_house = self._clock()
                if self._pull in ready:
                    for _ in range(self._frames_per_turn):
                        try:
                            frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._deliver(frames)
                        if self._clock() >= next_house:
                            break
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.exception("%s control thread: ZeroMQ error %s", self._name, exc)
                self._stop.wait(self._tick)

    def _deliver(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        try:
            self._on_frames(frames)
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("%s: handling a control message failed; dropped", self._name)

    def _housekeeping(self) -> float:
        try:
            return self._on_housekeeping()
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("%s: housekeeping failed; the thread goes on", self._name)
            return self._tick
