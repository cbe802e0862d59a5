"""Sessions between endpoints: who may speak for which peer, and whether it is still there.

A session is bound at the handshake (see `wire`): the decode mints an id and
a secret and sends them in HELLO; the prefill mints its own and sends them
in HELLO_ACK. Every later frame carries the id and secret its *receiver*
minted, so a frame is accepted only from a process that received our
handshake frame at the address it claimed. Nothing here does IO: the
endpoint feeds frames and clock readings in, and asks which sessions need a
heartbeat or are lost.

Bounds: a prefill holds at most `max_half_open` answered-but-unconfirmed
sessions (a HELLO flood evicts the oldest of those, never a confirmed one)
and at most `max_sessions` in all; each session owns one outgoing channel
(socket), so sockets are bounded by the same numbers.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .memory import KVPools

__all__ = ["Session", "SessionState", "SessionTable"]


class SessionState(str, enum.Enum):
    #: Decode side: HELLO sent, no answer yet.
    HANDSHAKE = "handshake"
    #: Prefill side: HELLO answered; the decode has not yet sent a frame proving it got the answer.
    HALF_OPEN = "half_open"
    #: Both sides hold each other's id and secret.
    UP = "up"
    #: Refused at the handshake, silent past the window, said BYE, or evicted.
    CLOSED = "closed"


class Session:
    """One session with one peer endpoint."""

    __slots__ = (
        "addr",
        "bye",
        "channel",
        "engine_id",
        "hello",
        "key",
        "last_seen",
        "peer_key",
        "peer_sid",
        "pools",
        "records",
        "refused",
        "sid",
        "state",
        "target",
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
        self.target: Any = None
        self.pools: KVPools | None = None
        self.engine_id: str | None = None
        # A prefill keeps the HELLO's engine session until the decode confirms (see _on_hello_sender).
        self.hello: tuple[dict[str, Any], bytes | None] | None = None
        self.refused: str | None = None
        self.bye = False
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
    ) -> None:
        self._clock = clock
        self.window = window
        self.max_sessions = max_sessions
        self.max_half_open = max_half_open
        self._by_sid: dict[str, Session] = {}
        # Half-open sessions, oldest first: the ones a HELLO flood evicts.
        self._half_open: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_sid.values()))

    @staticmethod
    def mint() -> tuple[str, str]:
        """A fresh session id and secret."""
        return secrets.token_hex(8), secrets.token_hex(16)

    def open(self, addr: str, state: SessionState) -> tuple[Session, list[Session]]:
        """Start a session with the peer at `addr`; returns it and the sessions evicted to make room."""
        evicted: list[Session] = []
        if state is SessionState.HALF_OPEN:
            while len(self._half_open) >= self.max_half_open:
                evicted.append(self._half_open.popitem(last=False)[1])
        while len(self._by_sid) - len(evicted) >= self.max_sessions and self._half_open:
            evicted.append(self._half_open.popitem(last=False)[1])
        for old in evicted:
            # Out of the table now; the caller closes each (`RemoteEndpoint._lose`).
            self._by_sid.pop(old.sid, None)
        if len(self._by_sid) >= self.max_sessions:
            raise OverflowError(f"{len(self._by_sid)} sessions are open, the most this endpoint holds")
        sid, key = self.mint()
        while sid in self._by_sid:
            sid, key = self.mint()
        session = Session(sid, key, addr, self._clock(), state)
        self._by_sid[sid] = session
        if state is SessionState.HALF_OPEN:
            self._half_open[sid] = session
        return session, evicted

    def authenticate(self, fields: Mapping[str, Any]) -> Session | None:
        """The live session a frame's `sid`/`key` name, or None (unknown id, wrong secret, closed)."""
        session = self._by_sid.get(fields["sid"])
        if session is None or not hmac.compare_digest(session.key, fields["key"]):
            return None
        if session.state is SessionState.CLOSED:
            return None
        return session

    def heard(self, session: Session) -> None:
        """A valid frame of `session` arrived: it is alive (and, if half-open, confirmed)."""
        session.last_seen = self._clock()
        if session.state is SessionState.HALF_OPEN:
            session.state = SessionState.UP
            self._half_open.pop(session.sid, None)

    def confirm(self, session: Session) -> None:
        """A decode's handshake was answered: the session is up."""
        session.state = SessionState.UP
        session.last_seen = self._clock()

    def close(self, session: Session) -> None:
        session.state = SessionState.CLOSED
        self._by_sid.pop(session.sid, None)
        self._half_open.pop(session.sid, None)

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
