"""The ZeroMQ control plane between a prefill and a decode process.

Cross-process engines (Mooncake, NIXL) move KV bytes; everything else two
endpoints must tell each other travels here: the handshake that exchanges
engine sessions and pool addresses, each room's destination pages and aux
slot, completion notices, ABORT and ABORT_ACK, and heartbeats.

Shape (as SGLang's Mooncake connector): every endpoint binds one PULL
socket at its `address` and keeps one PUSH socket per peer it talks to.
Every message names its sender (`from`, an id that changes when a process
restarts) and where to reply (`addr`), so no reply channel is needed.

Framing is versioned and validated. A message is two or three frames:

    [b"KVFSM/1", JSON object header, optional binary blob]

The header holds `type`, `from`, `addr` and the fields of that type (see
`SCHEMAS`). Anything else (wrong frame count, another magic or version,
bad JSON, an unknown type, a missing or mistyped field) is logged,
counted in `ControlStats` and dropped: it never reaches a handler, so it
can never change a room, and it never ends the receiving thread. A
handler that raises is logged and counted the same way.

Liveness: `watch(addr)` starts a peer's clock. Any valid message from it
counts as a sign of life, heartbeats go to every watched peer each
`heartbeat_interval`, and a peer silent for `heartbeat_interval *
heartbeat_misses` is reported once through `on_peer_lost` and unwatched.
A peer whose `from` id changes at the same address restarted: the old one
is reported lost first. One thread per endpoint does all receiving,
heartbeating and checking, so there is no thread per peer or timer.

This module knows nothing about rooms or states; the remote backend
(`kvfsm.backends.remote`) turns messages into lifecycle events.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import zmq

__all__ = [
    "MAGIC",
    "SCHEMAS",
    "ControlMessage",
    "ControlPlane",
    "ControlStats",
    "MalformedMessage",
    "decode_frames",
    "encode_message",
]

logger = logging.getLogger("kvfsm.backends.control")

#: First frame of every message: protocol name and version.
MAGIC = b"KVFSM/1"
#: Longest page list one ROOM message may carry (a sanity bound, not a limit of the design).
MAX_PAGES = 1 << 22
_MAX_TEXT = 4096
#: Seconds a peer that said BYE still counts as present (capped by the heartbeat interval).
_BYE_GRACE = 0.25


class MalformedMessage(ValueError):
    """A control message failed validation; the text says what was expected and what arrived."""

    def __init__(self, category: str, problem: str) -> None:
        self.category = category
        super().__init__(problem)


def _room_id(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and 0 < len(value) <= _MAX_TEXT
    )


def _text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= _MAX_TEXT


def _opt_text(value: object) -> bool:
    return value is None or _text(value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _opt_count(value: object) -> bool:
    return value is None or _count(value)


def _flag(value: object) -> bool:
    return isinstance(value, bool)


def _mapping(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def _pages(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_PAGES
        and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in value)
    )


_Check = Callable[[object], bool]
_HEADER: dict[str, tuple[_Check, str]] = {
    "type": (_text, "a message type string"),
    "from": (_text, "the sender's endpoint id (str)"),
    "addr": (_text, "the sender's control address (str)"),
}
_FIELD_DOCS: dict[_Check, str] = {
    _room_id: "a room id (int or non-empty str)",
    _text: "a str",
    _opt_text: "a str or null",
    _count: "an int >= 0",
    _opt_count: "an int >= 0 or null",
    _flag: "a bool",
    _mapping: "a JSON object",
    _pages: "a list of page indices (ints >= 0)",
}

#: Message type -> required fields and their checks. The header fields
#: `type`, `from` and `addr` are required on every message.
SCHEMAS: dict[str, dict[str, _Check]] = {
    # decode -> prefill: first contact; engine session and pool layout/addresses.
    "HELLO": {"role": _text, "engine": _text, "session": _mapping},
    # prefill -> decode: the answer, with the prefill's engine session.
    "HELLO_ACK": {"role": _text, "engine": _text, "session": _mapping},
    # decode -> prefill: one room's destination pages and aux slot.
    "ROOM": {"room": _room_id, "token": _text, "pages": _pages, "aux": _opt_count},
    # prefill -> decode: a chunk of the room landed (completion notice).
    "CHUNK": {"room": _room_id, "token": _text, "nbytes": _count, "last": _flag},
    # prefill -> decode: every chunk and the aux commit marker landed.
    "DONE": {"room": _room_id, "token": _text, "nbytes": _count},
    # either way: this side failed or aborted the room.
    "ABORT": {"room": _room_id, "token": _opt_text, "kind": _text, "message": _text},
    # prefill -> decode: the prefill's room failed and none of its writes into the decode's pages is in flight.
    "ABORT_ACK": {"room": _room_id, "token": _opt_text},
    "HEARTBEAT": {},
    # an endpoint shutting down on purpose: its peers need not wait for the heartbeat window.
    "BYE": {},
}


@attrs.frozen(slots=True)
class ControlMessage:
    """One validated message: its type, sender id, reply address, fields and blob."""

    type: str
    sender: str
    addr: str
    fields: dict[str, Any] = attrs.field(factory=dict)
    blob: bytes | None = None

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def encode_message(
    kind: str, sender: str, addr: str, fields: dict[str, Any] | None = None, blob: bytes | None = None
) -> list[bytes]:
    """The frames of one message. Raises `MalformedMessage` if it would not validate."""
    header = {"type": kind, "from": sender, "addr": addr, **(fields or {})}
    frames = [MAGIC, json.dumps(header, separators=(",", ":")).encode()]
    if blob is not None:
        frames.append(bytes(blob))
    decode_frames(frames)  # a sender bug must surface here, not as a drop on the peer
    return frames


def decode_frames(frames: list[bytes]) -> ControlMessage:
    """Validate the frames of one message; `MalformedMessage` names what is wrong."""
    if not 2 <= len(frames) <= 3:
        raise MalformedMessage("malformed", f"expected 2 or 3 frames (magic, header[, blob]); got {len(frames)}")
    magic = bytes(frames[0])
    if magic != MAGIC:
        if magic.startswith(b"KVFSM/"):
            raise MalformedMessage("bad_version", f"expected protocol {MAGIC!r}; got {magic[:32]!r}")
        raise MalformedMessage("malformed", f"expected magic frame {MAGIC!r}; got {magic[:32]!r}")
    try:
        header = json.loads(bytes(frames[1]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedMessage("malformed", f"header frame is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedMessage("malformed", f"header must be a JSON object; got {type(header).__name__}")
    for key, (check, doc) in _HEADER.items():
        if not check(header.get(key)):
            raise MalformedMessage("malformed", f"header field {key!r} must be {doc}; got {header.get(key)!r:.80}")
    kind = header["type"]
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise MalformedMessage("unknown_type", f"unknown message type {kind!r:.40}; known: {', '.join(SCHEMAS)}")
    fields: dict[str, Any] = {}
    for key, check in schema.items():
        if key not in header:
            raise MalformedMessage("malformed", f"{kind} needs field {key!r} ({_FIELD_DOCS[check]}); it is missing")
        value = header[key]
        if not check(value):
            raise MalformedMessage("malformed", f"{kind}.{key} must be {_FIELD_DOCS[check]}; got {value!r:.80}")
        fields[key] = value
    blob = bytes(frames[2]) if len(frames) == 3 else None
    return ControlMessage(kind, header["from"], header["addr"], fields, blob)


@attrs.define
class ControlStats:
    """Counters of one endpoint's control plane (read them from any thread)."""

    received: int = 0
    sent: int = 0
    malformed: int = 0
    bad_version: int = 0
    unknown_type: int = 0
    handler_errors: int = 0
    send_failures: int = 0
    heartbeats_sent: int = 0
    peers_lost: int = 0

    @property
    def dropped(self) -> int:
        """Messages received but never handed to a handler."""
        return self.malformed + self.bad_version + self.unknown_type


MessageHandler = Callable[[ControlMessage], None]
PeerLostHandler = Callable[[str, str | None, str], None]


class _Peer:
    __slots__ = ("addr", "bye", "last_seen", "lock", "peer_id", "socket", "watched")

    def __init__(self, addr: str, socket: zmq.Socket[bytes]) -> None:
        self.addr = addr
        self.socket = socket
        self.lock = threading.Lock()
        self.peer_id: str | None = None
        self.last_seen = 0.0
        self.watched = False
        self.bye = False


class ControlPlane:
    """One endpoint's control plane: a bound PULL socket, PUSH sockets to peers, one thread.

    `on_message(msg)` runs on the control thread for every valid message.
    `on_peer_lost(addr, peer_id, why)` runs there once per lost watched peer.
    `on_tick()` runs on every loop turn (at most every `tick` seconds), for
    adapters that poll an engine; it may return a shorter wait for the next
    turn (seconds) while it expects something soon. Handlers must not block
    for long.
    """

    def __init__(
        self,
        *,
        on_message: MessageHandler,
        on_peer_lost: PeerLostHandler,
        on_tick: Callable[[], float | None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat_interval: float = 1.0,
        heartbeat_misses: int = 3,
        tick: float = 0.02,
        name: str = "kvfsm",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval must be > 0 seconds; got {heartbeat_interval!r}")
        if isinstance(heartbeat_misses, bool) or not isinstance(heartbeat_misses, int) or heartbeat_misses < 1:
            raise ValueError(f"heartbeat_misses must be an int >= 1; got {heartbeat_misses!r}")
        self.endpoint_id = uuid.uuid4().hex
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_misses = heartbeat_misses
        self.stats = ControlStats()
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        self._on_tick = on_tick
        self._tick = float(tick)
        self._clock = clock
        self._name = name
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_heartbeat = 0.0

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the control thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-control", daemon=True)
        self._thread.start()

    def stop(self, *, say_bye: bool = True, timeout: float = 5.0) -> None:
        """Tell watched peers goodbye, stop the thread, close every socket. Idempotent."""
        if self._stop.is_set():
            return
        if say_bye:
            for addr in self.watched():
                self.send(addr, "BYE")
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._peers_lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            with peer.lock:
                peer.socket.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- peers -------------------------------------------------------------------------

    def _peer(self, addr: str) -> _Peer:
        with self._peers_lock:
            peer = self._peers.get(addr)
            if peer is None:
                if self._stop.is_set():
                    raise RuntimeError(f"control plane {self.address} is stopped")
                socket = self._ctx.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, 10000)
                socket.connect(addr)
                peer = self._peers[addr] = _Peer(addr, socket)
            return peer

    def watch(self, addr: str) -> None:
        """Start watching `addr` for liveness (its clock starts now) and heartbeating it."""
        peer = self._peer(addr)
        if not peer.watched:
            peer.last_seen = self._clock()
            peer.watched = True

    def unwatch(self, addr: str) -> None:
        peer = self._peers.get(addr)
        if peer is not None:
            peer.watched = False

    def watched(self) -> list[str]:
        with self._peers_lock:
            return [addr for addr, peer in self._peers.items() if peer.watched]

    def peer_id(self, addr: str) -> str | None:
        peer = self._peers.get(addr)
        return None if peer is None else peer.peer_id

    def forget(self, addr: str) -> None:
        """Drop the socket to `addr` (after it was lost): a later send reconnects afresh."""
        with self._peers_lock:
            peer = self._peers.pop(addr, None)
        if peer is not None:
            with peer.lock:
                peer.socket.close(linger=0)

    # -- sending -----------------------------------------------------------------------

    def send(self, addr: str, kind: str, fields: dict[str, Any] | None = None, blob: bytes | None = None) -> bool:
        """Queue one message to `addr` without blocking; False (and counted) if it could not be queued."""
        frames = encode_message(kind, self.endpoint_id, self.address, fields, blob)
        try:
            peer = self._peer(addr)
            with peer.lock:
                peer.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except (zmq.ZMQError, RuntimeError) as exc:
            self.stats.send_failures += 1
            logger.warning("%s: could not send %s to %s: %s", self._name, kind, addr, exc)
            return False
        self.stats.sent += 1
        return True

    def send_raw(self, addr: str, frames: list[bytes]) -> None:
        """Send arbitrary frames (tests use it to inject malformed traffic)."""
        peer = self._peer(addr)
        with peer.lock:
            peer.socket.send_multipart(frames, flags=zmq.NOBLOCK)

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        wait = self._tick
        while not self._stop.is_set():
            try:
                if wait >= 0.001:
                    ready = dict(poller.poll(int(wait * 1000)))
                else:
                    # Sub-millisecond turns (an engine asked to be polled often): zmq's
                    # timeout is in whole milliseconds, so look, then nap.
                    ready = dict(poller.poll(0))
                    if not ready:
                        time.sleep(wait)
                if self._pull in ready:
                    # Drain what is queued, bounded so heartbeats still go out under load.
                    for _ in range(256):
                        try:
                            frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(frames)
                self._housekeeping()
                wait = self._tick
                if self._on_tick is not None:
                    asked = self._on_tick()
                    if asked is not None:
                        wait = min(self._tick, asked)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.exception("%s control thread: ZeroMQ error %s", self._name, exc)
                self._stop.wait(self._tick)
            except Exception:
                self.stats.handler_errors += 1
                logger.exception("%s control thread: handler failed; the thread goes on", self._name)

    def _receive(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        try:
            message = decode_frames(frames)
        except MalformedMessage as exc:
            setattr(self.stats, exc.category, getattr(self.stats, exc.category) + 1)
            logger.warning("%s: dropped a %s control message: %s", self._name, exc.category.replace("_", " "), exc)
            return
        peer = self._peers.get(message.addr)
        if peer is not None:
            if peer.peer_id is not None and peer.peer_id != message.sender and peer.watched:
                # Same address, new process: the one we knew is gone.
                self._lose(peer, f"it restarted (id {peer.peer_id[:8]} -> {message.sender[:8]})")
                peer = self._peer(message.addr)
            peer.peer_id = message.sender
            peer.last_seen = self._clock()
        if message.type == "HEARTBEAT":
            return
        if message.type == "BYE":
            if peer is not None and peer.watched:
                # Lost after a short grace, not at once: what the peer's engine sent just
                # before (a NIXL notification travels outside this socket) may still land.
                peer.bye = True
                window = self.heartbeat_interval * self.heartbeat_misses
                peer.last_seen = self._clock() - window + min(self.heartbeat_interval, _BYE_GRACE)
            return
        try:
            self._on_message(message)
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("%s: handling %s from %s failed; dropped", self._name, message.type, message.addr)

    def _housekeeping(self) -> None:
        now = self._clock()
        window = self.heartbeat_interval * self.heartbeat_misses
        beat = now >= self._next_heartbeat
        if beat:
            self._next_heartbeat = now + self.heartbeat_interval
        with self._peers_lock:
            peers = [p for p in self._peers.values() if p.watched]
        for peer in peers:
            silent = now - peer.last_seen
            if silent > window:
                self._lose(
                    peer, "it shut down (BYE)" if peer.bye else f"no message for {silent:.2f}s (window {window:g}s)"
                )
            elif beat:
                self.send(peer.addr, "HEARTBEAT")
                self.stats.heartbeats_sent += 1

    def _lose(self, peer: _Peer, why: str) -> None:
        peer.watched = False
        self.stats.peers_lost += 1
        logger.warning("%s: peer %s lost: %s", self._name, peer.addr, why)
        peer_id = peer.peer_id
        self.forget(peer.addr)
        try:
            self._on_peer_lost(peer.addr, peer_id, why)
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("%s: peer-lost handler failed for %s", self._name, peer.addr)
