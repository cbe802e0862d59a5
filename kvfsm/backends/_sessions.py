"""Sessions between endpoints: who may speak for which peer, and whether it is still there.

A session is bound at the handshake (see `wire`): the decode mints an id and
a secret and sends them in HELLO; the prefill mints its own and sends them
in HELLO_ACK. Every later frame carries the id and secret its *receiver*
minted, so a frame is accepted only from a process that received our
handshake frame at the address it claimed. Nothing here does IO: the
endpoint feeds frames and clock readings in, and asks which sessions need a
heartbeat or are lost.

Bounds: a prefill holds at most `max_half_open` answered-but-unconfirmed
sessions, and at most `max_half_open_bytes` of their handshakes (a HELLO
flood evicts the oldest of those, never a confirmed one), and at most
`max_sessions` in all; each session owns one outgoing channel (socket), so
sockets are bounded by the same numbers. An evicted session is returned to
the caller, which tells its peer (BYE: "not accepted, try again"), so a
legitimate decode caught in a burst knows it at once and retries instead of
believing in a session that no longer exists.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from .memory import KVPools

__all__ = ["Session", "SessionState", "SessionTable"]


class SessionState(str, enum.Enum):
    #: Decode side: HELLO sent (or about to be), the session not confirmed by the prefill yet.
    HANDSHAKE = "handshake"
    #: Prefill side: HELLO answered; the decode has not yet sent a frame proving it got the answer.
    HALF_OPEN = "half_open"
    #: Both sides hold each other's id and secret, and each knows the other does.
    UP = "up"
    #: Refused at the handshake, silent past the window, said BYE, or evicted.
    CLOSED = "closed"


class Session:
    """One session with one peer endpoint."""

    __slots__ = (
        "addr",
        "answered",
        "attempt",
        "bye",
        "channel",
        "engine_id",
        "hello",
        "hello_at",
        "hello_bytes",
        "key",
        "lane",
        "last_seen",
        "markers",
        "notify",
        "peer_key",
        "peer_sid",
        "pools",
        "records",
        "refused",
        "sid",
        "state",
        "writes_in_flight",
    )

    def __init__(self, sid: str, key: str, addr: str, now: float, state: SessionState) -> None:
        self.sid = sid
        self.key = key
        self.addr = addr
        self.state = state
        self.last_seen = now
        self.peer_sid: str | None = None
        self.peer_key: str | None = None
        self.channel: Any = None
        self.pools: KVPools | None = None
        # Prefill side: the decode's commit-marker region (ptr, slots), if it named one (`_markers`).
        self.markers: tuple[int, int] | None = None
        # ... and whether it wants them as engine notifications instead of written (`_markers`).
        self.notify = False
        self.engine_id: str | None = None
        # A prefill keeps the HELLO's engine session until the decode confirms (see the prefill half).
        self.hello: tuple[dict[str, Any], bytes | None] | None = None
        # The bytes of that HELLO (what the half-open budget counts).
        self.hello_bytes = 0
        self.refused: str | None = None
        self.bye = False
        # Decode side: HELLO_ACK came (the prefill's confirmation has not yet), the handshake's
        # attempt number, and when the (next) HELLO goes out (None: it went).
        self.answered = False
        self.attempt = 0
        self.hello_at: float | None = None
        # Prefill side: the writer lane of this decode (every engine call about it runs there).
        self.lane: Any = None
        # Engine writes into this peer not ended yet (the prefill's back-pressure budget).
        self.writes_in_flight = 0
        # The room records of this session (keyed as each half likes).
        self.records: dict[Any, Any] = {}

    @property
    def auth(self) -> dict[str, str]:
        """The fields that authenticate a frame to the peer."""
        assert self.peer_sid is not None and self.peer_key is not None
        return {"sid": self.peer_sid, "key": self.peer_key}

    def __repr__(self) -> str:
        return f"<Session {self.sid} {self.state.value} peer={self.addr} records={len(self.records)}>"


class SessionTable:
    """Every session of one endpoint, by the id it minted."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        window: float,
        max_sessions: int,
        max_half_open: int,
        max_half_open_bytes: int = 64 << 20,
    ) -> None:
        self._clock = clock
        self.window = window
        self.max_sessions = max_sessions
        self.max_half_open = max_half_open
        self.max_half_open_bytes = max_half_open_bytes
        self._by_sid: dict[str, Session] = {}
        # Half-open sessions, oldest first: the ones a HELLO flood evicts.
        self._half_open: OrderedDict[str, Session] = OrderedDict()
        self._half_open_bytes = 0

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_sid.values()))

    @property
    def half_open(self) -> int:
        return len(self._half_open)

    @staticmethod
    def mint() -> tuple[str, str]:
        """A fresh session id and secret."""
        return secrets.token_hex(8), secrets.token_hex(16)

    def open(self, addr: str, state: SessionState, cost: int = 0) -> tuple[Session, list[Session]]:
        """Start a session with the peer at `addr`; returns it and the sessions evicted to make room.

        `cost` is what a half-open session holds (its HELLO's bytes). Raises
        `OverflowError` when only confirmed sessions are left to make room.
        """
        evicted: list[Session] = []
        if state is SessionState.HALF_OPEN:
            while self._half_open and (
                len(self._half_open) >= self.max_half_open or self._half_open_bytes + cost > self.max_half_open_bytes
            ):
                evicted.append(self._pop_half_open())
        while len(self._by_sid) >= self.max_sessions and self._half_open:
            evicted.append(self._pop_half_open())
        if len(self._by_sid) >= self.max_sessions:
            raise OverflowError(f"{len(self._by_sid)} sessions are open, the most this endpoint holds")
        sid, key = self.mint()
        while sid in self._by_sid:
            sid, key = self.mint()
        session = Session(sid, key, addr, self._clock(), state)
        self._by_sid[sid] = session
        if state is SessionState.HALF_OPEN:
            session.hello_bytes = cost
            self._half_open[sid] = session
            self._half_open_bytes += cost
        return session, evicted

    def _pop_half_open(self) -> Session:
        old = self._half_open.popitem(last=False)[1]
        self._half_open_bytes -= old.hello_bytes
        # Out of the table now; the caller closes it (`RemoteEndpoint._lose`) and tells its peer.
        self._by_sid.pop(old.sid, None)
        return old

    def authenticate(self, sid: str | None, key: str | None) -> Session | None:
        """The live session an envelope's `sid`/`key` name, or None (unknown id, wrong secret, closed)."""
        if sid is None or key is None:
            return None
        session = self._by_sid.get(sid)
        if session is None or not hmac.compare_digest(session.key, key):
            return None
        if session.state is SessionState.CLOSED:
            return None
        return session

    def heard(self, session: Session, now: float | None = None) -> None:
        """A valid frame of `session` arrived (at `now`): it is alive."""
        session.last_seen = self._clock() if now is None else now

    def promote(self, session: Session) -> None:
        """A half-open session's first frame is handled: the decode got our answer, the session is up."""
        if session.state is SessionState.HALF_OPEN:
            session.state = SessionState.UP
            self._forget_half_open(session)

    def confirm(self, session: Session) -> None:
        """A decode's handshake was confirmed by the prefill: the session is up."""
        session.state = SessionState.UP
        session.last_seen = self._clock()

    def close(self, session: Session) -> None:
        session.state = SessionState.CLOSED
        self._by_sid.pop(session.sid, None)
        self._forget_half_open(session)

    def _forget_half_open(self, session: Session) -> None:
        if self._half_open.pop(session.sid, None) is not None:
            self._half_open_bytes -= session.hello_bytes
        session.hello_bytes = 0

    def silent(self, now: float) -> list[Session]:
        """Sessions silent for longer than the window (half-open ones included)."""
        return [s for s in self._by_sid.values() if now - s.last_seen > self.window]

    def up(self) -> list[Session]:
        return [s for s in self._by_sid.values() if s.state is SessionState.UP]

    def find_up(self, addr: str) -> Session | None:
        """A decode's session with the prefill at `addr` that is up or handshaking (reused by new rooms)."""
        for session in self._by_sid.values():
            if session.addr == addr and session.state in (SessionState.UP, SessionState.HANDSHAKE) and not session.bye:
                return session
        return None
