"""What both halves of a remote endpoint share: config, counters, sessions, frames in and out.

A decode (receiver) and a prefill (sender) endpoint speak the protocol of
`kvfsm.backends.wire`. This module holds what neither half owns:
`RemoteConfig` (validated), `RemoteStats`, and `RemoteEndpoint`, the base
class that turns received bytes into authenticated frames (`receive`),
runs the session layer (handshake bookkeeping, heartbeats, liveness, BYE)
and the periodic work (`housekeeping`), and sends the frames a wire row
declares (`_emit`). Each half implements the handlers of the frames its
role receives and the wire rows of its records.

No IO happens here: frames go out through `self.transport` (ZeroMQ in
production, a simulated network in tests/property/test_wire_model.py),
time comes from the manager's clock, and the writer thread of the prefill
is started by `remote.py`. Handle events are never fired while the
endpoint's lock is held: each handler collects them and fires them after
releasing it, so an observer that calls back into the endpoint (the
backend's own `_stop`) never finds it half-way through a change.
"""

from __future__ import annotations

import abc
import logging
import math
import secrets
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from .._errors import ConfigError
from .._states import FailureKind, FailureReason, Role
from . import codec, wire
from ._remote_engine import EngineAdapter
from ._sessions import Session, SessionState, SessionTable
from ._transport import Transport
from .base import KVBackend, KVPools, MemoryRegion

__all__ = [
    "Fire",
    "RemoteConfig",
    "RemoteEndpoint",
    "RemoteStats",
    "SeenClaims",
    "Transport",
    "new_generation",
    "peer_reason",
    "pools_fields",
    "pools_from_fields",
    "step",
]

logger = logging.getLogger("kvfsm.backends.remote")

#: Handle events collected under the endpoint's lock, fired after it is released.
Fire = list[Callable[[], object]]

#: Seconds a peer that said BYE still counts as present (capped by the heartbeat interval).
_BYE_GRACE = 0.25
#: Claim generations a session remembers after their records were dropped, so a replayed
#: or duplicated claim of a finished transfer is recognised.
_SEEN_PER_SESSION = 16384


def _positive(name: str, *, zero: bool = False) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"RemoteConfig.{name} must be a number of seconds; got {value!r}")
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            bound = ">= 0" if zero else "> 0"
            raise ConfigError(f"RemoteConfig.{name} must be finite and {bound}; got {value!r}")

    return check


def _count(name: str, low: int, high: int | None = None) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise ConfigError(f"RemoteConfig.{name} must be an int {span}; got {value!r}")

    return check


def _host(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > 255:
        raise ConfigError(f"RemoteConfig.host must be a host name or address; got {value!r}")


def _key(value: object) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise ConfigError(f"RemoteConfig.shared_key must be bytes, a str or None; got {type(value).__name__}")


def _key_length(_instance: object, _attribute: attrs.Attribute[Any], value: bytes | None) -> None:
    if value is not None and len(value) < 16:
        raise ConfigError(f"RemoteConfig.shared_key must be at least 16 bytes; got {len(value)}")


@attrs.frozen(slots=True)
class RemoteConfig:
    """Where an endpoint listens, how fast it notices a dead peer, and its bounds.

    A peer silent for `heartbeat_interval * heartbeat_misses` seconds is
    lost. `poll_interval` is the longest the prefill's writer naps while
    writes are in flight and none moved (it naps 20 us first, doubling).
    `max_writes_in_flight` caps the engine writes in flight to one decode
    (None: the engine's own safe figure, e.g. half of Mooncake's per-peer
    TCP queue); the rest wait, shared fairly between rooms.
    `pending_ttl` bounds how long the prefill keeps a decode's
    claim (or abort) that arrived before its own `bootstrap()`, and how long
    it holds a room id whose generation ended unclaimed. `shared_key`
    (16 bytes or more, the same on every endpoint) authenticates the
    handshake itself: without it any process that reaches the control port
    can open a session of its own (see the docs' threat model).
    `max_sessions` and `max_half_open` bound sessions (and so sockets);
    `max_pending`, `max_pending_per_session` and `max_pending_pages` bound
    the early claims and aborts held for rooms not bootstrapped yet (in
    entries, and in the pages those claims list).
    """

    host: str = attrs.field(default="127.0.0.1", validator=_host)
    port: int = attrs.field(default=0, validator=_count("port", 0, 65535))
    heartbeat_interval: float = attrs.field(default=1.0, validator=_positive("heartbeat_interval"))
    heartbeat_misses: int = attrs.field(default=3, validator=_count("heartbeat_misses", 1))
    poll_interval: float = attrs.field(default=0.001, validator=_positive("poll_interval", zero=True))
    pending_ttl: float = attrs.field(default=300.0, validator=_positive("pending_ttl"))
    shared_key: bytes | None = attrs.field(default=None, converter=_key, validator=_key_length, repr=False)
    max_sessions: int = attrs.field(default=256, validator=_count("max_sessions", 1))
    max_half_open: int = attrs.field(default=16, validator=_count("max_half_open", 1))
    max_pending: int = attrs.field(default=65536, validator=_count("max_pending", 1))
    max_pending_per_session: int = attrs.field(default=4096, validator=_count("max_pending_per_session", 1))
    max_pending_pages: int = attrs.field(default=1 << 20, validator=_count("max_pending_pages", 1))
    max_writes_in_flight: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_count("max_writes_in_flight", 1))
    )

    @property
    def peer_window(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses


@attrs.define
class RemoteStats:
    """Counters of one remote endpoint (beyond the control plane's)."""

    #: Authenticated frames that named no live record of their session, or came in a wire state
    #: whose table does not take them (late, duplicated, replayed).
    stale_messages: int = 0
    #: Authenticated frames naming a known (room, gen) with another prefill generation.
    wrong_generation: int = 0
    rejected_rooms: int = 0
    duplicate_rooms: int = 0
    ambiguous_claims: int = 0
    held_room_refusals: int = 0
    pending_dropped: int = 0
    engine_timeouts: int = 0
    engine_failures: int = 0
    engine_busy: int = 0
    jobs_submitted: int = 0
    writes_submitted: int = 0
    aborts_sent: int = 0
    abort_acks_sent: int = 0
    abort_acks_received: int = 0
    peers_lost: int = 0
    sessions_refused: int = 0
    #: HELLOs dropped because every session this endpoint may hold is confirmed.
    hellos_dropped: int = 0


def pools_fields(pools: KVPools) -> dict[str, Any]:
    def regions(items: tuple[MemoryRegion, ...]) -> list[list[Any]]:
        return [[r.ptr, r.nbytes, r.page_nbytes, r.dtype, r.device] for r in items]

    return {"kv": regions(pools.kv), "aux": regions(pools.aux)}


def pools_from_fields(fields: Any) -> KVPools:
    """Rebuild a peer's pool description from its session (raises ValueError/TypeError if bad)."""
    if not isinstance(fields, dict):
        raise TypeError(f"session.pools must be an object; got {type(fields).__name__}")

    def regions(items: Any, what: str) -> list[MemoryRegion]:
        if not isinstance(items, list) or len(items) > 4096:
            raise TypeError(f"session.pools.{what} must be a list of at most 4096 regions; got {items!r:.80}")
        out = []
        for i, item in enumerate(items):
            if not (isinstance(item, list) and len(item) == 5):
                raise TypeError(
                    f"session.pools.{what}[{i}] must be [ptr, nbytes, page_nbytes, dtype, device]; got {item!r:.80}"
                )
            ptr, nbytes, page_nbytes, dtype, device = item
            if not (dtype is None or isinstance(dtype, str)) or not isinstance(device, str):
                raise TypeError(f"session.pools.{what}[{i}]: dtype and device must be strings; got {item!r:.80}")
            out.append(MemoryRegion(ptr, nbytes, page_nbytes, device=device, dtype=dtype, name=f"{what}{i}"))
        return out

    return KVPools(regions(fields.get("kv"), "kv"), regions(fields.get("aux", []), "aux"))


def peer_reason(session: Session, frame: codec.Frame) -> FailureReason:
    """The failure an ABORT from the peer becomes on this side."""
    try:
        kind = FailureKind(frame["kind"])
    except ValueError:
        kind = FailureKind.PEER_FAILED
    text = f"peer {session.addr}: {frame['message']}"
    if kind in (FailureKind.ABORTED, FailureKind.BOOTSTRAP_ERROR):
        return FailureReason(kind, text, from_peer=True)
    return FailureReason(FailureKind.PEER_FAILED, f"{text} ({kind.value})", from_peer=True)


def new_generation() -> int:
    """A decode generation: random, positive, 63 bits (never the same twice in practice)."""
    gen = 0
    while gen == 0:
        gen = secrets.randbits(63)
    return gen


def step(table: wire.WireTable, record: Any, input: str) -> wire.WireRow | None:
    """Move `record.wire` by `table`'s row for `input`; None (and no change) when the table has none."""
    row = table.row(record.wire, input)
    if row is not None:
        record.wire = row.dest
    return row


class SeenClaims:
    """The generations of one session's claims whose records are gone, oldest forgotten first.

    A decode mints a fresh random generation for every open, so within one
    session a generation alone names a claim; keeping only the int bounds
    the memory whatever the room ids (`_SEEN_PER_SESSION` per session).
    """

    __slots__ = ("_gens", "_order")

    def __init__(self) -> None:
        self._gens: set[int] = set()
        self._order: deque[int] = deque()

    def add(self, gen: int) -> None:
        if gen not in self._gens:
            self._gens.add(gen)
            self._order.append(gen)
            if len(self._order) > _SEEN_PER_SESSION:
                self._gens.discard(self._order.popleft())

    def __contains__(self, gen: object) -> bool:
        return gen in self._gens


class RemoteEndpoint(KVBackend):
    """The session layer and the frame plumbing both halves of an endpoint use."""

    config: RemoteConfig
    engine: EngineAdapter
    remote_stats: RemoteStats
    transport: Transport
    sessions: SessionTable
    _lock: threading.Lock
    _next_heartbeat: float
    #: Whether the frames this endpoint sends are checked field by field before they go out.
    #: Off in production (they are built from values checked when they came in); the test
    #: suite turns it on (tests/conftest.py), so a sender bug fails there, not at a peer.
    check_frames: bool = False

    @abc.abstractmethod
    def _make_engine(self) -> EngineAdapter:
        """Create and initialise the engine (raise `BackendError` if it cannot run here)."""

    def _timeout_fails(self) -> bool:
        return False

    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def control(self) -> Any:
        """The transport (kept under its old name: tests and tools read `control.stats`)."""
        return self.transport

    def _clock_now(self) -> float:
        return self.manager._clock()

    def _register_pools(self, pools: KVPools) -> None:
        self.engine.register([*pools.kv, *pools.aux])

    def _session_fields(self) -> tuple[dict[str, Any], bytes | None]:
        assert self.pools is not None
        fields, blob = self.engine.session()
        return {**fields, "pools": pools_fields(self.pools)}, blob

    # -- frames out --------------------------------------------------------------------------

    def _send_frame(self, session: Session, kind: str, fields: dict[str, Any], blob: bytes | None = None) -> bool:
        """Send one authenticated frame of `session` (lock held or not: the transport does not call back)."""
        if session.channel is None or session.state is SessionState.CLOSED:
            return False
        frames = codec.encode(kind, {**session.auth, **fields}, blob, check=self.check_frames)
        return bool(self.transport.send(session.channel, frames))

    def _emit(self, session: Session | None, row: wire.WireRow, build: Callable[[str], dict[str, Any]]) -> None:
        """Send the messages `row` declares, in order; `build(kind)` gives each one's room fields."""
        if session is None:
            return
        for kind in row.sends:
            fields = build(kind)
            blob = fields.pop("_blob", None)
            if kind == "ABORT":
                self.remote_stats.aborts_sent += 1
            elif kind == "ABORT_ACK":
                self.remote_stats.abort_acks_sent += 1
            self._send_frame(session, kind, fields, blob)

    # -- frames in ---------------------------------------------------------------------------

    def receive(self, frames: list[bytes]) -> None:
        """One message from the transport: validate, authenticate, dispatch. Never raises on bad input."""
        stats = self.transport.stats
        try:
            frame = codec.decode(frames)
        except codec.MalformedFrame as exc:
            setattr(stats, exc.category, getattr(stats, exc.category) + 1)
            logger.debug("kvfsm %s: dropped a %s control message: %s", self.name, exc.category, exc)
            return
        spec = wire.SPECS[frame.type]
        mine = wire.Sender.PREFILL if self.role is Role.SENDER else wire.Sender.DECODE
        if spec.sender is mine:
            # A frame only the other role sends: whoever sent it is not our peer.
            self.remote_stats.stale_messages += 1
            return
        if frame.type == "HELLO":
            self._on_hello(frame)
            return
        fire: Fire = []
        with self._lock:
            session = self.sessions.authenticate(frame.fields)
            if session is None:
                stats.unauthenticated += 1
                return
            if session.refused is not None:
                self.remote_stats.stale_messages += 1
                return
            confirming = session.state is SessionState.HALF_OPEN
            self.sessions.heard(session)
            if confirming and not self._confirmed(session):
                return
            if frame.type == "HEARTBEAT":
                return
            if frame.type == "BYE":
                session.bye = True
                # Lost after a short grace, not at once: what the peer's engine wrote just
                # before may still be landing.
                session.last_seen = (
                    self._clock_now() - self.config.peer_window + min(self.config.heartbeat_interval, _BYE_GRACE)
                )
                return
            self._on_frame(session, frame, fire)
        for event in fire:
            event()

    def _confirmed(self, session: Session) -> bool:
        """A half-open session's first frame arrived (lock held); False if the session is refused now."""
        return True

    @abc.abstractmethod
    def _on_hello(self, frame: codec.Frame) -> None:
        """A HELLO (only a prefill takes them)."""

    @abc.abstractmethod
    def _on_frame(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        """An authenticated frame of `session` (lock held); handle events go into `fire`."""

    # -- the periodic work ----------------------------------------------------------------------

    def housekeeping(self, now: float | None = None) -> float:
        """Heartbeats, lost peers and expiries; returns the seconds until it wants to run again.

        `now` defaults to the manager's clock, the one every deadline and
        time-to-live of the endpoint is measured on.
        """
        if now is None:
            now = self._clock_now()
        fire: Fire = []
        lost: list[tuple[Session, str]] = []
        with self._lock:
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + self.config.heartbeat_interval
                for session in self.sessions.up():
                    self._send_frame(session, "HEARTBEAT", {})
                    self.transport.stats.heartbeats_sent += 1
            window = self.config.peer_window
            for session in self.sessions.silent(now):
                if session.bye:
                    why = "it shut down (BYE)"
                elif session.state is SessionState.HANDSHAKE:
                    why = f"it did not answer the handshake within {window:g}s"
                else:
                    why = f"no message for {now - session.last_seen:.2f}s (window {window:g}s)"
                lost.append((session, why))
            for session, why in lost:
                self._lose(session, why, fire)
            self._expire(now, fire)
        for event in fire:
            event()
        wait = self._next_heartbeat - now
        hint = self._poll_engine(now)
        return wait if hint is None else min(wait, hint)

    def _poll_engine(self, now: float) -> float | None:
        """Engine work the control thread does (the decode's NIXL progress); a shorter wait if busy."""
        return None

    @abc.abstractmethod
    def _expire(self, now: float, fire: Fire) -> None:
        """Drop what outlived its time-to-live (lock held)."""

    def _lose(self, session: Session, why: str, fire: Fire) -> None:
        """`session` is gone: close it and fail what depended on it (lock held).

        A half-open session (a HELLO answered, never confirmed) was never a
        peer: it is dropped quietly, counted as evicted, not as a lost peer.
        """
        was = session.state
        self.sessions.close(session)
        if was is SessionState.HALF_OPEN:
            self.transport.stats.sessions_evicted += 1
            logger.debug("kvfsm %s: unconfirmed session with %s dropped: %s", self.name, session.addr, why)
        else:
            self.remote_stats.peers_lost += 1
            self.transport.stats.peers_lost += 1
            logger.warning("kvfsm %s %s: session with %s lost: %s", self.name, self.role.value, session.addr, why)
        if session.channel is not None:
            self.transport.close_channel(session.channel)
            session.channel = None
        if session.target is not None:
            target, session.target = session.target, None
            fire.append(lambda: self.engine.remove_peer(target))
        self._session_lost(session, was, why, fire)

    @abc.abstractmethod
    def _session_lost(self, session: Session, was: SessionState, why: str, fire: Fire) -> None:
        """Fail the records of a lost session (lock held)."""

    def _say_bye(self) -> None:
        with self._lock:
            for session in self.sessions.up():
                self._send_frame(session, "BYE", {})

    def _verify_mac(self, kind: str, frame: codec.Frame) -> bool:
        """With a shared key, whether a handshake frame carries the right MAC (constant time)."""
        key = self.config.shared_key
        if key is None:
            return True
        mac = frame["mac"]
        expected = codec.handshake_mac(key, kind, frame.fields, frame.blob)
        return isinstance(mac, str) and secrets.compare_digest(mac, expected)

    def _mac(self, kind: str, fields: dict[str, Any], blob: bytes | None) -> str | None:
        key = self.config.shared_key
        return None if key is None else codec.handshake_mac(key, kind, {**fields, "mac": None}, blob)
