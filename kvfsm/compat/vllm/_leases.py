"""Leases: a prefill's held blocks live only while their decode keeps saying it will load them.

A prefill holds a finished request's blocks for a decode it cannot see. If
that decode died, or the router gave the request to nobody, the blocks
would stay pinned until `hold_timeout` (480 s: "P could hold GBs of dead
blocks for 8 minutes", vLLM #41383). So, as vLLM's NixlConnector does, each
hold is a lease of `lease_duration` seconds (30 by default), renewed by
the decode's scheduler for every request it still intends to load, from
the moment the request reaches it until its load ended; a lease nobody
renews expires and its blocks are freed. A decode that is loading holds
its prefill's room past the lease's phase (the workers' room left
Bootstrapping when the decode claimed it), so an expiry never frees blocks
under a load: those rooms follow their own deadlines and the peer's
heartbeats.

`LeaseBook` (prefill) keeps one lease per held request as a room of a
`kvfsm.TransferManager` whose bootstrap deadline is the lease: expiry is
the manager's per-phase deadline FIFO (one structure, DESIGN.md rule 7),
checked once per engine step, with no thread and no timer per request. A
renewal starts the lease afresh (the room is closed and opened again: a
new generation, a new deadline at the FIFO's tail, O(1)). `LeaseRenewer`
(decode) sends the renewals every `lease_duration / 6` seconds, and at
once for a request it just met. `LeaseChannel` carries them: one ZeroMQ
PULL socket per prefill scheduler (on the port after its TP ranks' ports,
`_connector.dp_port`), PUSH sockets on the decode, frames bounded in size
and count, authenticated with `shared_key` when one is set (HMAC-SHA256),
and never blocking: a renewal that cannot be sent now is dropped (the
next one comes within the interval). Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..._errors import ConfigError, UnknownRoom
from ..._lifecycle import Timeouts
from ..._manager import TransferManager
from ..._states import KVPoll, Role

__all__ = ["LeaseBook", "LeaseChannel", "LeaseRenewer", "Renewals"]

logger = logging.getLogger("kvfsm.compat.vllm")

#: Request ids in one renewal frame; more go in further frames.
MAX_IDS_PER_FRAME = 1024
#: Longest engine or request id a decode renews: a frame of `MAX_IDS_PER_FRAME` of them fits
#: `MAX_FRAME_BYTES`, so one client's oversized id cannot sink the renewals of the others.
MAX_ID_CHARS = 512
#: Largest frame a prefill reads (1024 ids of up to 512 characters, JSON): bigger ones are dropped.
MAX_FRAME_BYTES = 1 << 20
#: Frames a prefill reads per engine step (the rest wait for the next step).
MAX_FRAMES_PER_STEP = 256


class Renewals(Protocol):
    """What carries renewals (a `LeaseChannel`, or a test's stand-in)."""

    def send(self, host: str, port: int, engine_id: str, request_ids: list[str], tp_size: int = 0) -> None: ...

    def receive(self) -> list[tuple[str, list[str], int]]: ...


class LeaseBook:
    """The prefill's leases: one per held request, expiring on the manager's deadlines."""

    def __init__(self, duration: float, clock: Callable[[], float]) -> None:
        self.duration = duration
        self.manager = TransferManager(
            Role.SENDER, timeouts=Timeouts(bootstrap=duration, waiting=None, transferring=None, drain=None), clock=clock
        )
        self.renewed = 0
        self.late_renewals = 0
        # The manager tells each expiry once, whichever status read or check enforced it.
        self._expired: list[str] = []
        self.manager.subscribe(lambda change: self._expired.append(str(change.room)), events=["timeout"])

    def grant(self, request_id: str) -> None:
        """A new hold: its lease runs from now."""
        if request_id in self.manager:
            self.manager.close(request_id)
        self.manager.open(request_id)

    def renew(self, request_id: str) -> bool:
        """Start the lease of `request_id` afresh; False if it has none or it already expired."""
        try:
            live = self.manager.status(request_id) is KVPoll.Bootstrapping  # enforces the deadline first
        except UnknownRoom:
            live = False
        if not live:
            self.late_renewals += 1
            return False
        self.manager.close(request_id)
        self.manager.open(request_id)
        self.renewed += 1
        return True

    def end(self, request_id: str) -> None:
        """The hold ended (its blocks were freed): no lease any more."""
        if request_id in self.manager:
            self.manager.close(request_id)

    def expired(self) -> list[str]:
        """The holds whose lease ran out since the last call (their leases are gone)."""
        self.manager.check_deadlines()
        gone, self._expired = self._expired, []
        for room in gone:
            if room in self.manager:
                self.manager.close(room)
        return gone

    def __len__(self) -> int:
        return len(self.manager)


class LeaseRenewer:
    """The decode's side: which prefill requests it still intends to load, renewed on a schedule."""

    def __init__(self, duration: float, clock: Callable[[], float], renewals: Renewals, tp_size: int = 1) -> None:
        """`tp_size`: this decode's, sent along: a prefill of a smaller TP size slices its heads for it."""
        self.interval = duration / 6
        self.tp_size = tp_size
        self._clock = clock
        self._renewals = renewals
        #: Local request id -> (host, lease port, prefill engine id, prefill request id).
        self._intents: dict[str, tuple[str, int, str, str]] = {}
        self._last = float("-inf")
        self._new = False
        self.sent_frames = 0
        self.too_long = 0

    def intend(self, request_id: str, host: str, port: int, engine_id: str, remote_request_id: str) -> None:
        """Renew `remote_request_id`'s lease at `engine_id` until `drop`; ids past `MAX_ID_CHARS` are not."""
        if len(remote_request_id) > MAX_ID_CHARS or len(engine_id) > MAX_ID_CHARS:
            self.too_long += 1  # its own hold then lasts one lease; nobody else's renewals suffer
            return
        if request_id not in self._intents:
            self._intents[request_id] = (host, port, engine_id, remote_request_id)
            self._new = True

    def drop(self, request_id: str) -> None:
        self._intents.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._intents

    def tick(self) -> None:
        """Once per engine step: send the renewals if due (or if a request is new)."""
        now = self._clock()
        if not self._intents or (not self._new and now - self._last < self.interval):
            return
        self._last, self._new = now, False
        by_prefill: dict[tuple[str, int, str], list[str]] = {}
        for host, port, engine, remote in self._intents.values():
            by_prefill.setdefault((host, port, engine), []).append(remote)
        for (host, port, engine), ids in by_prefill.items():
            for start in range(0, len(ids), MAX_IDS_PER_FRAME):
                self._renewals.send(host, port, engine, ids[start : start + MAX_IDS_PER_FRAME], self.tp_size)
                self.sent_frames += 1


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


class LeaseChannel:
    """Renewals over ZeroMQ: a PULL socket on the prefill, PUSH sockets on the decode. Never blocks."""

    def __init__(self, shared_key: str | None = None, *, high_water: int = 64) -> None:
        import zmq

        self._zmq = zmq
        self._context: Any = zmq.Context.instance()
        self._key = shared_key.encode() if shared_key else None
        self._high_water = high_water
        self._pull: Any = None
        self._push: dict[tuple[str, int], Any] = {}
        self.dropped = 0
        self.unsent = 0

    def listen(self, host: str, port: int) -> None:
        """Bind the prefill's renewal port; `ConfigError` (naming it) if it cannot."""
        zmq = self._zmq
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 4 * MAX_FRAMES_PER_STEP)
        try:
            sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ConfigError(
                f"the kvfsm connector's lease port {host}:{port} cannot be bound ({exc}); it is the port after "
                "this engine's TP ranks' ports (kv_connector_extra_config 'port' + tp_size, per DP rank)"
            ) from exc
        self._pull = sock

    def send(self, host: str, port: int, engine_id: str, request_ids: list[str], tp_size: int = 0) -> None:
        zmq = self._zmq
        sock = self._push.get((host, port))
        if sock is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._high_water)
            sock.connect(f"tcp://{host}:{port}")
            self._push[(host, port)] = sock
        body = json.dumps({"v": 1, "engine": engine_id, "requests": request_ids, "tp": tp_size}).encode()
        frames = [body] if self._key is None else [body, _mac(self._key, body)]
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.unsent += 1  # the prefill is not reading (or not there): the next renewal retries

    def receive(self) -> list[tuple[str, list[str], int]]:
        """The renewals that arrived (engine, request ids, the decode's TP size or 0), at most
        `MAX_FRAMES_PER_STEP` frames; malformed ones dropped (counted)."""
        if self._pull is None:
            return []
        zmq = self._zmq
        got: list[tuple[str, list[str], int]] = []
        for _ in range(MAX_FRAMES_PER_STEP):
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            parsed = self._parse(frames)
            if parsed is None:
                self.dropped += 1
            else:
                got.append(parsed)
        return got

    def _parse(self, frames: list[bytes]) -> tuple[str, list[str], int] | None:
        if self._key is not None:
            if len(frames) != 2 or not hmac.compare_digest(frames[1], _mac(self._key, frames[0])):
                return None
        elif len(frames) != 1:
            return None
        try:
            message = json.loads(frames[0])
        except ValueError:
            return None
        if not isinstance(message, dict) or message.get("v") != 1:
            return None
        engine, ids = message.get("engine"), message.get("requests")
        if not isinstance(engine, str) or not isinstance(ids, list) or len(ids) > MAX_IDS_PER_FRAME:
            return None
        if not all(isinstance(i, str) for i in ids):
            return None
        tp = message.get("tp", 0)
        if isinstance(tp, bool) or not isinstance(tp, int) or not 0 <= tp <= 1 << 16:
            return None
        return engine, ids, tp

    def close(self) -> None:
        for sock in [*self._push.values(), *([self._pull] if self._pull is not None else [])]:
            sock.close(0)
        self._push.clear()
        self._pull = None


def renew_all(
    book: LeaseBook, engine_id: str, renewals: Iterable[tuple[str, list[str], int]], seen: dict[str, int] | None = None
) -> int:
    """Apply the renewals naming `engine_id` (others are for another engine: ignored); how many renewed.

    `seen` collects, per renewed request, the TP size its decode announced.
    """
    count = 0
    for engine, ids, tp in renewals:
        if engine != engine_id:
            continue
        for request_id in ids:
            renewed = book.renew(request_id)
            count += renewed
            if renewed and seen is not None and tp:
                seen[request_id] = tp
    return count
