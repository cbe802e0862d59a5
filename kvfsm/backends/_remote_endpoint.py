"""What both halves of a remote endpoint share: config, counters, sessions, frames in and out.

A decode (receiver) and a prefill (sender) endpoint speak the protocol of
`kvfsm.backends.wire`. This module holds what neither half owns:
`RemoteConfig` (validated), `RemoteStats`, and `RemoteEndpoint`, the
session layer both halves are built on. A `RemoteBackend` (`remote.py`)
holds exactly one half (`DecodeEndpoint` or `PrefillEndpoint`): the roles
are composed, not mixed.

The session layer turns received bytes into authenticated frames in two
steps. `admit(frames)` runs as each message arrives: it reads the envelope
(never the JSON header), authenticates the session, notes that its peer
was heard *now* (liveness is judged by arrival, not by when a frame is
handled), checks a handshake's MAC, and returns the rest of the work, or
nothing for a frame that names no session. The transport runs that work
in arrival order, later in the same turn (`receive` does both at once).
It also runs the periodic work (`housekeeping`: heartbeats, liveness,
expiries) and sends the frames a wire row declares (`_emit`). Each half
implements the handlers of the frames its role receives and the wire
rows of its records.

No IO happens here: frames go out through `self.transport` (ZeroMQ in
production, a simulated network in tests/property/test_wire_model.py),
time comes from the manager's clock, and the prefill's writer lanes get
their threads only when `remote.py` says so. Handle events are never fired
while the endpoint's lock is held: each handler collects them and fires
them after releasing it, so an observer that calls back into the endpoint
(the backend's own `_stop`) never finds it half-way through a change.
"""

from __future__ import annotations

import abc
import logging
import math
import secrets
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import attrs

from .._errors import ConfigError
from .._states import FailureKind, FailureReason, Role
from . import codec, wire
from ._markers import MarkerSlots
from ._remote_engine import EngineAdapter
from ._sessions import Session, SessionState, SessionTable
from ._transport import ControlStats, Transport
from .base import KVPools, MemoryRegion

if TYPE_CHECKING:
    from .._manager import TransferHandle, TransferManager

__all__ = [
    "Fire",
    "Host",
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
#: Most bytes of HELLOs a prefill keeps for its half-open sessions (a keyless flood of
#: large handshakes evicts the oldest, it does not grow the process).
_HALF_OPEN_BYTES = 64 << 20


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


def _flag(name: str, *, none: bool = False) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_instance: object, _attribute: attrs.Attribute[Any], value: object) -> None:
        if not (isinstance(value, bool) or (none and value is None)):
            allowed = "True, False or None" if none else "True or False"
            raise ConfigError(f"RemoteConfig.{name} must be {allowed}; got {value!r}")

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
    `max_sessions` and `max_half_open` bound sessions (and so sockets):
    256 decodes bootstrapping at the same instant all fit the defaults, and
    a decode whose half-open session is evicted anyway is told and tries
    again (`handshake_attempts` times in all, then its rooms fail with
    `BOOTSTRAP_ERROR`). `engine_call_timeout` bounds an engine call about
    one decode (its first write opens Mooncake's segment with a
    synchronous handshake): past it, that decode's session is lost and its
    rooms fail, while the calls about every other decode go on in their own
    lanes;
    `max_pending`, `max_pending_per_session` and `max_pending_pages` bound
    the early claims and aborts held for rooms not bootstrapped yet (in
    entries, and in the pages those claims list).
    `completion_markers` completes rooms on the data plane (`_markers`):
    the prefill writes a room's commit marker into the decode's memory once
    every write landed, and the decode, which reads its claimed rooms'
    `marker_slots` every `marker_poll_interval` seconds while any is
    claimed, succeeds without waiting for DONE (which still follows). On an
    engine that carries notifications (NIXL) the marker is sent as one
    instead, read where the decode polls the engine anyway. `None` (the
    default) leaves it to the engine: on with NIXL, where it took a third
    to a half off a one-page room here and cost no throughput; off with
    Mooncake, where over TCP on loopback a write of 24 bytes took as long
    as DONE's trip over ZeroMQ, so the marker saved nothing and its polling
    cost CPU (docs/performance.md). Where a small write is far cheaper than
    a control message (RDMA) turn it on. Set it alike on both sides; a
    prefill writes markers only to decodes that claim with one, and with it
    off (or no slot free) DONE alone completes a room.
    """

    host: str = attrs.field(default="127.0.0.1", validator=_host)
    port: int = attrs.field(default=0, validator=_count("port", 0, 65535))
    heartbeat_interval: float = attrs.field(default=1.0, validator=_positive("heartbeat_interval"))
    heartbeat_misses: int = attrs.field(default=3, validator=_count("heartbeat_misses", 1))
    poll_interval: float = attrs.field(default=0.001, validator=_positive("poll_interval", zero=True))
    pending_ttl: float = attrs.field(default=300.0, validator=_positive("pending_ttl"))
    shared_key: bytes | None = attrs.field(default=None, converter=_key, validator=_key_length, repr=False)
    max_sessions: int = attrs.field(default=512, validator=_count("max_sessions", 1))
    max_half_open: int = attrs.field(default=256, validator=_count("max_half_open", 1))
    handshake_attempts: int = attrs.field(default=8, validator=_count("handshake_attempts", 1))
    engine_call_timeout: float = attrs.field(default=10.0, validator=_positive("engine_call_timeout"))
    max_pending: int = attrs.field(default=65536, validator=_count("max_pending", 1))
    max_pending_per_session: int = attrs.field(default=4096, validator=_count("max_pending_per_session", 1))
    max_pending_pages: int = attrs.field(default=1 << 20, validator=_count("max_pending_pages", 1))
    max_writes_in_flight: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_count("max_writes_in_flight", 1))
    )
    completion_markers: bool | None = attrs.field(default=None, validator=_flag("completion_markers", none=True))
    marker_slots: int = attrs.field(default=4096, validator=_count("marker_slots", 1, 1 << 20))
    marker_poll_interval: float = attrs.field(default=0.00005, validator=_positive("marker_poll_interval"))

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
    #: HELLOs refused because every session this endpoint may hold is confirmed (told: BYE).
    hellos_dropped: int = 0
    #: Decode side: handshakes tried again after the prefill did not accept one (or went silent).
    handshake_retries: int = 0
    #: Prefill side: sessions lost because an engine call about their decode did not return in time.
    engine_calls_stuck: int = 0
    #: Engine calls that raised where a status was expected (a job's poll, cancel or release).
    engine_errors: int = 0
    #: Decode side: rooms that succeeded on their commit marker, before their DONE came.
    marker_completions: int = 0
    #: Prefill side: commit markers written, and those not written or failed (DONE completed those rooms).
    markers_written: int = 0
    markers_missed: int = 0
    #: Decode side: engine notifications that completed nothing (not a marker, not our token, not
    #: from that room's prefill, or the room no longer waiting).
    notifications_dropped: int = 0


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


class Host(Protocol):
    """What an endpoint half needs of the `KVBackend` that holds it."""

    name: str
    manager: TransferManager
    pools: KVPools | None

    def _reject(self, handle: TransferHandle, problem: str) -> NoReturn: ...

    def _timeout_fails(self) -> bool: ...


class RemoteEndpoint(abc.ABC):
    """The session layer and the frame plumbing both halves of an endpoint use."""

    #: Whether the frames this endpoint sends are checked field by field before they go out.
    #: Off in production (they are built from values checked when they came in); the test
    #: suite turns it on (tests/conftest.py), so a sender bug fails there, not at a peer.
    check_frames: bool = False
    #: The messages this half sends (a frame of that kind arriving here is not from a peer).
    sends: wire.Sender

    def __init__(self, host: Host, config: RemoteConfig, engine: EngineAdapter) -> None:
        self.host = host
        self.name = host.name
        self.manager = host.manager
        self.role: Role = host.manager.role
        self.config = config
        self.engine = engine
        self.remote_stats = RemoteStats()
        self._lock = threading.Lock()
        self._next_heartbeat = 0.0
        self.sessions = SessionTable(
            self.manager._clock,
            window=config.peer_window,
            max_sessions=config.max_sessions,
            max_half_open=config.max_half_open,
            max_half_open_bytes=_HALF_OPEN_BYTES,
        )
        self.transport: Transport = _NoTransport()
        # Completion on the data plane (`_markers`): the decode's slots are where prefills write
        # its rooms' markers, the prefill's are where those markers are written from.
        markers = engine.notifies if config.completion_markers is None else config.completion_markers
        self.markers: MarkerSlots | None = MarkerSlots(config.marker_slots) if markers else None

    @property
    def pools(self) -> KVPools | None:
        return self.host.pools

    @property
    def address(self) -> str:
        return self.transport.address

    def _clock_now(self) -> float:
        return self.manager._clock()

    def _session_fields(self) -> tuple[dict[str, Any], bytes | None]:
        assert self.pools is not None
        fields, blob = self.engine.session()
        fields = {**fields, "pools": pools_fields(self.pools)}
        if self.markers is not None:
            fields["markers"] = [self.markers.ptr, self.markers.slots]
        return fields, blob

    def _layout_mismatch(self, pools: KVPools, session: dict[str, Any]) -> str | None:
        """Why the peer, with `pools` and engine `session` fields, cannot exchange KV with us (None: it can).

        Both halves ask this at the handshake. Here: page for page
        (`KVPools.layout_mismatch`). A half whose writes move parts of
        pages (SGLang's unequal tensor parallelism, head slices) checks its
        own geometry instead, and writes it with `PrefillEndpoint._kv_writes`.
        """
        assert self.pools is not None
        return self.pools.layout_mismatch(pools)

    def _reject(self, handle: TransferHandle, problem: str) -> NoReturn:
        self.host._reject(handle, problem)

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

    def _handshake_frames(self, kind: str, fields: dict[str, Any], blob: bytes | None) -> list[bytes]:
        """A HELLO or HELLO_ACK, with its MAC when a shared key is set."""
        return codec.encode(kind, fields, blob, check=self.check_frames, mac_key=self.config.shared_key)

    # -- frames in ---------------------------------------------------------------------------

    def receive(self, frames: list[bytes]) -> None:
        """One message from the transport: admit it, then handle it. Never raises on bad input."""
        work = self.admit(frames)
        if work is not None:
            work()

    def admit(self, frames: list[bytes]) -> Callable[[], None] | None:
        """What a message costs on arrival: its envelope, its session, its MAC; never its JSON.

        Returns the rest of its handling (run it in arrival order), or None
        when the message is dropped here: malformed, not from a peer, naming
        no session of ours, or a handshake without the shared key's MAC. An
        authenticated message counts its session as heard now, however long
        the messages before it take to handle.
        """
        stats = self.transport.stats
        try:
            head = codec.envelope(frames)
        except codec.MalformedFrame as exc:
            setattr(stats, exc.category, getattr(stats, exc.category) + 1)
            logger.debug("kvfsm %s: dropped a %s control message: %s", self.name, exc.category, exc)
            return None
        if head.spec.sender is self.sends:
            # A frame only our own role sends: whoever sent it is not our peer.
            self.remote_stats.stale_messages += 1
            return None
        key = self.config.shared_key
        if head.type == "HELLO":
            if key is not None and not codec.verify_mac(key, head, frames):
                stats.unauthenticated += 1
                return None
            return lambda: self._handle_hello(head, frames)
        with self._lock:
            session = self.sessions.authenticate(head.sid, head.key)
            if session is None:
                stats.unauthenticated += 1
                return None
            if head.spec.handshake and key is not None and not codec.verify_mac(key, head, frames):
                stats.unauthenticated += 1
                return None
            self.sessions.heard(session, self._clock_now())
        return lambda: self._handle(session, head, frames)

    def _handle_hello(self, head: codec.Envelope, frames: list[bytes]) -> None:
        try:
            frame = codec.decode_body(head, frames)
        except codec.MalformedFrame as exc:
            self._count_malformed(exc)
            return
        self._on_hello(frame, sum(len(f) for f in frames))

    def _handle(self, session: Session, head: codec.Envelope, frames: list[bytes]) -> None:
        if head.spec.fields:
            try:
                frame = codec.decode_body(head, frames)
            except codec.MalformedFrame as exc:
                self._count_malformed(exc)
                return
        else:
            frame = codec.Frame(head.type, {"sid": head.sid, "key": head.key})
        fire: Fire = []
        with self._lock:
            if session.state is SessionState.CLOSED or session.refused is not None:
                self.remote_stats.stale_messages += 1
                return
            if self._heard(session, frame, fire):
                if frame.type == "BYE":
                    self._on_bye(session, fire)
                elif frame.type != "HEARTBEAT":
                    self._on_frame(session, frame, fire)
        for event in fire:
            event()

    def _count_malformed(self, exc: codec.MalformedFrame) -> None:
        stats = self.transport.stats
        setattr(stats, exc.category, getattr(stats, exc.category) + 1)
        logger.debug("kvfsm %s: dropped a %s control message: %s", self.name, exc.category, exc)

    def _heard(self, session: Session, frame: codec.Frame, fire: Fire) -> bool:
        """A frame of `session` is handled now (lock held): confirm the handshake if due; False to drop it."""
        return True

    def _on_bye(self, session: Session, fire: Fire) -> None:
        """The peer shuts down (lock held): lost after a short grace, not at once.

        What the peer's engine wrote just before may still be landing.
        """
        session.bye = True
        session.last_seen = (
            self._clock_now() - self.config.peer_window + min(self.config.heartbeat_interval, _BYE_GRACE)
        )

    @abc.abstractmethod
    def _on_hello(self, frame: codec.Frame, nbytes: int) -> None:
        """A HELLO of `nbytes` bytes (only a prefill takes them)."""

    @abc.abstractmethod
    def _on_frame(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        """An authenticated room frame (or HELLO_ACK) of `session` (lock held); handle events go into `fire`."""

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
                    why = f"it did not complete the handshake within {window:g}s"
                else:
                    why = f"no message for {now - session.last_seen:.2f}s (window {window:g}s)"
                lost.append((session, why))
            for session, why in lost:
                self._lose(session, why, fire)
            hint = self._expire(now, fire)
        for event in fire:
            event()
        wait = self._next_heartbeat - now
        if hint is not None:
            wait = min(wait, max(0.0, hint - now))
        engine = self._poll_engine(now)
        return wait if engine is None else min(wait, engine)

    def _poll_engine(self, now: float) -> float | None:
        """Engine work the control thread does (the decode's NIXL progress); a shorter wait if busy."""
        return None

    @abc.abstractmethod
    def _expire(self, now: float, fire: Fire) -> float | None:
        """Drop what outlived its time-to-live (lock held); when it wants to run again, if sooner."""

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
        elif was is SessionState.UP:
            self.remote_stats.peers_lost += 1
            self.transport.stats.peers_lost += 1
            logger.warning("kvfsm %s %s: session with %s lost: %s", self.name, self.role.value, session.addr, why)
        if session.channel is not None:
            self.transport.close_channel(session.channel)
            session.channel = None
        self._session_lost(session, was, why, fire)

    @abc.abstractmethod
    def _session_lost(self, session: Session, was: SessionState, why: str, fire: Fire) -> None:
        """Fail the records of a lost session (lock held)."""

    def say_bye(self) -> None:
        with self._lock:
            for session in self.sessions.up():
                self._send_frame(session, "BYE", {})

    def shutdown(self) -> None:
        """Stop this half's own work (threads); the backend stops the transport and the engine."""
        return

    # -- the backend's calls, by role ------------------------------------------------------------

    @abc.abstractmethod
    def bootstrap(self, handle: TransferHandle, peer: str) -> None: ...

    @abc.abstractmethod
    def stop(self, handle: TransferHandle) -> None: ...

    @abc.abstractmethod
    def forget(self, handle: TransferHandle) -> None: ...


class _NoTransport:
    """Where frames go before `RemoteBackend` attached the real transport (nowhere)."""

    address = "unattached"

    def __init__(self) -> None:
        self.stats = ControlStats()

    def connect(self, addr: str) -> Any:
        raise RuntimeError("no transport attached yet")

    def send(self, channel: Any, frames: list[bytes]) -> bool:
        return False

    def close_channel(self, channel: Any, *, flush: bool = False) -> None:
        return

    def wake(self) -> None:
        return
