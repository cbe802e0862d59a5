"""What both halves of a remote endpoint share: config, counters, peers, encodings.

A decode (receiver) and a prefill (sender) endpoint speak one protocol
(see `kvfsm.backends.remote`). The pieces of it that neither half owns
live here, so the two halves cannot drift apart: `RemoteConfig` and
`RemoteStats`, the record of one peer endpoint (`PeerRecord`), how a pool
layout travels in a session, the engine notification that carries a
chunk's completion (NIXL), the failure reason an ABORT from the peer
becomes, and `RemoteEndpoint`, the base class holding the state both
halves read (engine, peers, lock, control plane) and sending ABORT.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Hashable
from typing import Any

import attrs

from .._states import FailureKind, FailureReason
from ._remote_engine import EngineAdapter
from .base import KVBackend, KVPools, MemoryRegion
from .control import ControlMessage, ControlPlane

__all__ = [
    "PeerRecord",
    "RemoteConfig",
    "RemoteEndpoint",
    "RemoteStats",
    "notification",
    "parse_notification",
    "peer_reason",
    "pools_fields",
    "pools_from_fields",
]


@attrs.frozen(slots=True)
class RemoteConfig:
    """Where an endpoint listens and how fast it notices a dead peer.

    A peer silent for `heartbeat_interval * heartbeat_misses` seconds is
    lost. `poll_interval` is how long the transfer worker sleeps when
    nothing moved. `pending_ttl` bounds how long the prefill keeps a room's
    metadata (or abort) that arrived before its own `bootstrap()`.
    """

    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval: float = 1.0
    heartbeat_misses: int = 3
    poll_interval: float = 0.0002
    pending_ttl: float = 300.0

    @property
    def peer_window(self) -> float:
        return self.heartbeat_interval * self.heartbeat_misses


@attrs.define
class RemoteStats:
    """Counters of one remote endpoint (beyond the control plane's)."""

    stale_messages: int = 0
    unknown_rooms: int = 0
    duplicate_rooms: int = 0
    rejected_rooms: int = 0
    engine_timeouts: int = 0
    engine_failures: int = 0
    jobs_submitted: int = 0
    writes_submitted: int = 0
    aborts_sent: int = 0
    abort_acks_sent: int = 0
    abort_acks_received: int = 0
    peers_lost: int = 0


def pools_fields(pools: KVPools) -> dict[str, Any]:
    return {
        "kv": [[r.ptr, r.nbytes, r.page_nbytes, r.dtype] for r in pools.kv],
        "aux": [[r.ptr, r.nbytes, r.page_nbytes, r.dtype] for r in pools.aux],
    }


def pools_from_fields(fields: Any) -> KVPools:
    """Rebuild a peer's pool description from its session (raises ValueError/TypeError if bad)."""
    if not isinstance(fields, dict):
        raise TypeError(f"session.pools must be an object; got {type(fields).__name__}")

    def regions(items: Any, what: str) -> list[MemoryRegion]:
        if not isinstance(items, list):
            raise TypeError(f"session.pools.{what} must be a list; got {type(items).__name__}")
        out = []
        for i, item in enumerate(items):
            if not (isinstance(item, list) and len(item) == 4):
                raise TypeError(
                    f"session.pools.{what}[{i}] must be [ptr, nbytes, page_nbytes, dtype]; got {item!r:.80}"
                )
            ptr, nbytes, page_nbytes, dtype = item
            out.append(MemoryRegion(ptr, nbytes, page_nbytes, dtype=dtype, name=f"{what}{i}"))
        return out

    return KVPools(regions(fields.get("kv"), "kv"), regions(fields.get("aux", []), "aux"))


class PeerRecord:
    """A decode's view of one prefill endpoint (or the reverse)."""

    __slots__ = ("addr", "answered", "pools", "refused", "rooms", "target")

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.answered = False
        self.refused: str | None = None
        self.pools: KVPools | None = None
        self.target: Any = None
        self.rooms: set[str] = set()


_NOTIFY_PREFIX = b"kvfsm1|"


def notification(token: str, nbytes: int, *, last: bool) -> bytes:
    """The engine notification of a chunk: `kvfsm1|<token>|<nbytes>|<0 or 1 for last>`."""
    return _NOTIFY_PREFIX + f"{token}|{nbytes}|{int(last)}".encode()


def parse_notification(message: bytes) -> tuple[str, int, bool] | None:
    if not message.startswith(_NOTIFY_PREFIX):
        return None
    try:
        token, nbytes, last = message[len(_NOTIFY_PREFIX) :].decode().split("|")
        if last not in ("0", "1") or int(nbytes) < 0:
            return None
        return token, int(nbytes), last == "1"
    except (UnicodeDecodeError, ValueError):
        return None


def peer_reason(message: ControlMessage) -> FailureReason:
    try:
        kind = FailureKind(message["kind"])
    except ValueError:
        kind = FailureKind.PEER_FAILED
    text = f"peer {message.addr}: {message['message']}"
    if kind in (FailureKind.ABORTED, FailureKind.BOOTSTRAP_ERROR):
        return FailureReason(kind, text, from_peer=True)
    return FailureReason(FailureKind.PEER_FAILED, f"{text} ({kind.value})", from_peer=True)


class RemoteEndpoint(KVBackend):
    """The state both halves of an endpoint read, and what both do: describe the session, send ABORT."""

    config: RemoteConfig
    engine: EngineAdapter
    remote_stats: RemoteStats
    control: ControlPlane
    _lock: threading.Lock
    _peers: dict[str, PeerRecord]

    @abc.abstractmethod
    def _make_engine(self) -> EngineAdapter:
        """Create and initialise the engine (raise `BackendError` if it cannot run here)."""

    def _timeout_fails(self) -> bool:
        return False

    @property
    def address(self) -> str:
        return self.control.address

    def _register_pools(self, pools: KVPools) -> None:
        self.engine.register([*pools.kv, *pools.aux])

    def _session(self) -> tuple[dict[str, Any], bytes | None]:
        assert self.pools is not None
        fields, blob = self.engine.session()
        return {**fields, "pools": pools_fields(self.pools)}, blob

    def _send_abort(self, addr: str, room: Hashable, token: str | None, reason: FailureReason | None) -> None:
        if addr not in self._peers:
            return  # lost or never met: nobody to tell (and no socket to reopen for it)
        kind = reason.kind.value if reason is not None else FailureKind.ABORTED.value
        text = reason.message if reason is not None else "aborted"
        self.remote_stats.aborts_sent += 1
        self.control.send(addr, "ABORT", {"room": room, "token": token, "kind": kind, "message": text})
