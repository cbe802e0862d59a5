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
* a message is handled in two steps: `on_frames(frames)` runs as it is
  received and may return the rest of its handling, which runs later in
  the turn, in arrival order (the endpoint authenticates there, before any
  JSON, and notes the sender as heard);
* each loop turn takes at most `frames_per_turn` messages and ends its
  handling early when housekeeping is due; before housekeeping runs, every
  message that arrived meanwhile is taken in first (up to the backlog's
  bounds: `max_backlog` messages, `max_backlog_bytes`), so a peer is
  judged by when its frames arrived, not by how long the frames before
  them took to handle;
* ZeroMQ serves its connections fairly, so one flooding connection delays
  another's frames by a bounded share, not indefinitely;
* a frame whose handling raises is counted in `ControlStats.handler_errors`
  and the thread goes on.

A channel closed with `flush=True` (a BYE to a decode whose handshake is
not accepted) stays open for `_LINGER` seconds so the frame can leave; at
most `_LINGERING` such channels are kept, the oldest closed first, so a
flood of HELLOs cannot pile up sockets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from . import wire
from ._naps import precise_naps
from ._transport import ControlStats

__all__ = ["Channel", "ControlPlane", "ControlStats"]

logger = logging.getLogger("kvfsm.backends.control")

#: Seconds a channel closed with `flush=True` stays open so its last frames can leave.
_LINGER = 1.0
#: Most such channels kept at once (the oldest is closed outright past it).
_LINGERING = 32

#: What `on_frames` may return: the rest of a message's handling, run later in the turn.
Work = Callable[[], object]


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

    `on_frames(frames)` runs on the thread for every message received, as
    it is received; it may return a callable, the rest of the message's
    handling, which runs later in the same turn, in arrival order.
    `on_housekeeping()` runs at least every `tick` seconds whatever
    arrives, and returns when it wants to run next (seconds from now).
    The thread keeps its own time (`clock`, real time by default); the
    endpoint reads whatever clock it keeps inside its housekeeping.
    """

    def __init__(
        self,
        *,
        on_frames: Callable[[list[bytes]], Work | None],
        on_housekeeping: Callable[[], float],
        host: str = "127.0.0.1",
        port: int = 0,
        tick: float = 0.05,
        frames_per_turn: int = 64,
        max_message_bytes: int = wire.MAX_HEADER_BYTES + 4096,
        receive_queue: int = 1000,
        max_backlog: int = 4096,
        max_backlog_bytes: int = 64 << 20,
        name: str = "kvfsm",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats = ControlStats()
        self._on_frames = on_frames
        self._on_housekeeping = on_housekeeping
        self._tick = float(tick)
        self._frames_per_turn = frames_per_turn
        self._max_backlog = max_backlog
        self._max_backlog_bytes = max_backlog_bytes
        # Messages taken in whose handling has not run yet: (bytes, work), in arrival order.
        self._backlog: deque[tuple[int, Work]] = deque()
        self._backlog_bytes = 0
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
        # Channels closed with flush=True, still open until their deadline: (deadline, channel).
        self._lingering: deque[tuple[float, Channel]] = deque()
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
            channels = list(self._channels) + [channel for _deadline, channel in self._lingering]
            self._channels.clear()
            self._lingering.clear()
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
        return len(self._channels) + len(self._lingering)

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

    def close_channel(self, channel: Channel, *, flush: bool = False) -> None:
        """Close a channel; with `flush`, only once what was sent on it could leave (bounded, see above)."""
        pushed_out: list[Channel] = []
        with self._channels_lock:
            self._channels.discard(channel)
            if flush and not self._stop.is_set():
                self._lingering.append((self._clock() + _LINGER, channel))
                while len(self._lingering) > _LINGERING:
                    pushed_out.append(self._lingering.popleft()[1])
            else:
                pushed_out.append(channel)
        for old in pushed_out:
            self._close_socket(old)

    def _close_lingering(self, now: float) -> None:
        due: list[Channel] = []
        with self._channels_lock:
            while self._lingering and self._lingering[0][0] <= now:
                due.append(self._lingering.popleft()[1])
        for channel in due:
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
                    # Whatever arrived while the frames before it were handled is taken in first:
                    # its senders count as heard before anyone's liveness is judged.
                    self._take_in(None)
                    self.stats.backlog = len(self._backlog)
                    next_house = now + min(self._tick, max(0.0, self._housekeeping()))
                    self._close_lingering(now)
                wait = 0.0 if self._backlog else next_house - self._clock()
                if wait >= 0.001:
                    ready = dict(poller.poll(int(wait * 1000)))
                else:
                    # A sub-millisecond turn (an engine that wants polling, or work waiting):
                    # ZeroMQ's timeout is in whole milliseconds, so look, and nap only if nothing came.
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
                    self._take_in(self._frames_per_turn)
                # Handle what came, in arrival order, until housekeeping is due (one at least).
                while self._backlog:
                    nbytes, work = self._backlog.popleft()
                    self._backlog_bytes -= nbytes
                    self._run_work(work)
                    if self._clock() >= next_house:
                        break
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.exception("%s control thread: ZeroMQ error %s", self._name, exc)
                self._stop.wait(self._tick)

    def _take_in(self, most: int | None) -> None:
        """Receive up to `most` messages (None: all there are), within the backlog's bounds."""
        taken = 0
        while (most is None or taken < most) and (
            len(self._backlog) < self._max_backlog and self._backlog_bytes < self._max_backlog_bytes
        ):
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            taken += 1
            work = self._deliver(frames)
            if work is not None:
                nbytes = sum(len(frame) for frame in frames)
                self._backlog.append((nbytes, work))
                self._backlog_bytes += nbytes

    def _deliver(self, frames: list[bytes]) -> Work | None:
        self.stats.received += 1
        try:
            work = self._on_frames(frames)
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("%s: handling a control message failed; dropped", self._name)
            return None
        return work if callable(work) else None

    def _run_work(self, work: Work) -> None:
        try:
            work()
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
