"""What every cross-process engine shares: peers, rooms, abort, heartbeats.

`RemoteBackend` is the one place where the cross-process lifecycle lives,
so Mooncake and NIXL cannot drift apart (SGLang's copy-pasted `abort()`,
DESIGN.md bug 2). An engine plugs in below it as an `EngineAdapter`: it
registers memory, describes its session, and submits and polls writes.
Above it, the adapter only emits events on handles (DESIGN.md rule 1).

Protocol between a decode (receiver) and a prefill (sender) endpoint, over
the control plane of `kvfsm.backends.control`:

    decode                                   prefill
    bootstrap(h, prefill_addr)
      HELLO (engine session, pools)  ----->  add peer, watch it
                                     <-----  HELLO_ACK (its session, pools)
      h.bootstrapped()
    expect(h, pages, aux)
      ROOM (room, token, pages, aux) ----->  bootstrap(h): h.bootstrapped()
                                             send(h, chunk) ... send(h, last=True)
                                             engine writes, polled by a worker
                                     <-----  CHUNK / DONE notices (Mooncake), or
                                             the WRITE notification (NIXL)
      transfer_started, chunk_done, transfer_done

Every room message carries a token minted by the decode at bootstrap:
a message whose token does not match the live room it names is dropped
and counted, so a reused room id never receives a stale message.

Failure and abort, from either side (DESIGN.md bug 5, SGLang #35049):

* decode room fails (abort, timeout, peer lost): it is `Failed` at once
  (the core did it). The adapter sends ABORT; the prefill fails its room,
  stops issuing writes, waits until none of its writes into the decode's
  pages is in flight, then answers ABORT_ACK. Only then does the decode
  call `writes_drained()`; without an ACK the drain deadline decides. If
  the decode never sent its pages, nothing can land: drained at once.
* prefill room fails: ABORT goes out at once (the decode fails with
  `ABORTED` or `PEER_FAILED`, from the peer), and ABORT_ACK follows when
  the prefill's writes drained.
* a peer silent for the heartbeat window (or saying BYE): every
  non-terminal room with that peer fails with `PEER_LOST` (or
  `BOOTSTRAP_ERROR` if it never answered the handshake). Its pages wait
  for the drain deadline: a peer we cannot hear may still be writing.

A ROOM or ABORT may reach the prefill before its scheduler calls
`bootstrap()` for that room; it is kept for `pending_ttl` seconds.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

import attrs

from .._manager import TransferHandle, TransferManager
from .._states import TERMINAL, FailureKind, FailureReason, KVPoll, Role
from .base import BackendError, KVBackend, KVPools, MemoryRegion
from .control import ControlMessage, ControlPlane

__all__ = ["RemoteConfig", "RemoteBackend", "EngineAdapter", "EngineJob", "PartialSubmit", "Write", "coalesce_runs"]

logger = logging.getLogger("kvfsm.backends.remote")

#: While a decode expects data it polls a notifying engine every _BUSY_TICK
#: seconds, for _BUSY_SPAN seconds after its last page request or notification.
_BUSY_TICK = 0.0001
_BUSY_SPAN = 0.05

#: Closed-before-claimed rooms a prefill remembers (bounded memory).
_MAX_TOMBSTONES = 65536

#: One write: (source address, destination address, length in bytes).
Write = tuple[int, int, int]


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


def coalesce_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """Group page pairs into runs contiguous on both sides: (src_start, dst_start, count)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


# -- the engine below -------------------------------------------------------------------


class EngineJob(abc.ABC):
    """Writes submitted to an engine as one unit, polled until they end."""

    @abc.abstractmethod
    def poll(self) -> str:
        """ "done", "pending", "failed" or "timeout" (slow; may still complete)."""

    def cancel(self) -> bool:
        """Try to stop the writes; True when none of them can land any more."""
        return False

    def release(self) -> None:
        """Free engine resources once the job ended (or was cancelled)."""
        return

    #: What the job moves, for messages.
    detail: str = ""
    #: Set when the job ended in a way that does not prove its writes stopped
    #: (a synchronous batch that gave up on a timeout): its room is then never
    #: reported drained; the drain deadline decides.
    may_still_land: bool = False


class PartialSubmit(BackendError):
    """Submitting failed after some writes went out; `job` holds those, to be waited for."""

    def __init__(self, job: EngineJob, message: str) -> None:
        super().__init__(message)
        self.job = job


class EngineAdapter(abc.ABC):
    """The engine-specific part of a cross-process backend."""

    name: str = "?"
    #: True when the engine tells the receiver about completion itself (NIXL
    #: notifications); False when the prefill sends CHUNK/DONE notices.
    notifies_receiver: bool = False

    @abc.abstractmethod
    def register(self, regions: list[MemoryRegion]) -> None:
        """Register the endpoint's memory."""

    @abc.abstractmethod
    def session(self) -> tuple[dict[str, Any], bytes | None]:
        """What a peer needs to reach this engine: JSON fields and an optional blob."""

    @abc.abstractmethod
    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        """Open the peer's engine session; returns what `submit` needs to target it."""

    def remove_peer(self, target: Any) -> None:
        return

    @abc.abstractmethod
    def submit(self, target: Any, writes: list[Write], notify: bytes | None) -> EngineJob:
        """Start writes into the peer's memory; `notify` (if the engine notifies) rides along."""

    def notify(self, target: Any, message: bytes) -> None:
        """Send a standalone notification (engines that notify the receiver)."""
        raise NotImplementedError

    def receiver_notifications(self) -> list[bytes]:
        """New completion notifications that reached this (receiver) engine."""
        return []

    def close(self) -> None:
        return


# -- per-room records --------------------------------------------------------------------


def _pools_fields(pools: KVPools) -> dict[str, Any]:
    return {
        "kv": [[r.ptr, r.nbytes, r.page_nbytes, r.dtype] for r in pools.kv],
        "aux": [[r.ptr, r.nbytes, r.page_nbytes, r.dtype] for r in pools.aux],
    }


def _pools_from_fields(fields: Any) -> KVPools:
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


class _Peer:
    """A decode's view of one prefill endpoint (or the reverse)."""

    __slots__ = ("addr", "answered", "pools", "refused", "rooms", "target")

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.answered = False
        self.refused: str | None = None
        self.pools: KVPools | None = None
        self.target: Any = None
        self.rooms: set[str] = set()


class _RecvRoom:
    __slots__ = ("aux", "handle", "pages", "pages_sent", "peer", "token")

    def __init__(self, handle: TransferHandle, token: str, peer: str) -> None:
        self.handle = handle
        self.token = token
        self.peer = peer
        self.pages: list[int] | None = None
        self.aux: int | None = None
        self.pages_sent = False


class _Chunk:
    __slots__ = ("aux_src", "dst", "jobs", "last", "nbytes", "src", "submitted", "tail")

    def __init__(self, src: list[int], dst: list[int], last: bool, aux_src: int | None, nbytes: int) -> None:
        self.src, self.dst, self.last, self.aux_src, self.nbytes = src, dst, last, aux_src, nbytes
        self.jobs: list[EngineJob] = []
        self.submitted = False
        # The last chunk's commit marker (aux write or notification) goes out after every KV write landed.
        self.tail: EngineJob | None = None


class _SendRoom:
    __slots__ = (
        "aux",
        "chunks",
        "cursor",
        "failed_sent",
        "handle",
        "jobs_inflight",
        "pages",
        "peer",
        "room",
        "stopped",
        "timeouts_seen",
        "token",
        "undrained",
    )

    def __init__(
        self, room: Hashable, handle: TransferHandle | None, token: str, peer: str, pages: list[int], aux: int | None
    ) -> None:
        self.room = room
        self.handle = handle
        self.token = token
        self.peer = peer
        self.pages = pages
        self.aux = aux
        self.cursor = 0
        self.chunks: deque[_Chunk] = deque()
        self.jobs_inflight: list[EngineJob] = []
        self.stopped = False
        self.failed_sent = False
        self.timeouts_seen = 0
        self.undrained = False


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


# -- the backend ----------------------------------------------------------------------------


class RemoteBackend(KVBackend):
    """A `KVBackend` whose peer is another process; subclasses pick the engine."""

    def __init__(self, manager: TransferManager, config: RemoteConfig | None = None) -> None:
        if config is None:
            config = RemoteConfig()
        if not isinstance(config, RemoteConfig):
            raise TypeError(f"config must be a RemoteConfig; got {type(config).__name__}: {config!r}")
        self.config = config
        self.engine = self._make_engine()
        self.remote_stats = RemoteStats()
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        # receiver
        self._recv_by_token: dict[str, _RecvRoom] = {}
        self._recv_token_of: dict[tuple[Hashable, int], str] = {}
        # sender
        self._send_by_room: dict[Hashable, _SendRoom] = {}
        self._waiting: dict[Hashable, TransferHandle] = {}
        self._pending: dict[Hashable, tuple[float, _SendRoom | None, ControlMessage]] = {}
        self._closed_unclaimed: OrderedDict[Hashable, tuple[float, FailureReason | None]] = OrderedDict()
        self._work: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._busy_until = 0.0
        # Decode rooms whose pages the prefill knows and whose data has not all landed.
        self._expecting: set[str] = set()
        super().__init__(manager)
        self.control = ControlPlane(
            on_message=self._on_message,
            on_peer_lost=self._on_peer_lost,
            on_tick=self._on_tick if (manager.role is Role.RECEIVER and self.engine.notifies_receiver) else None,
            host=config.host,
            port=config.port,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_misses=config.heartbeat_misses,
            tick=0.001 if (manager.role is Role.RECEIVER and self.engine.notifies_receiver) else 0.01,
            name=f"kvfsm-{self.name}-{manager.role.value}",
        )
        self.control.start()
        if manager.role is Role.SENDER:
            self._worker = threading.Thread(target=self._work_loop, name=f"kvfsm-{self.name}-writer", daemon=True)
            self._worker.start()

    @abc.abstractmethod
    def _make_engine(self) -> EngineAdapter:
        """Create and initialise the engine (raise `BackendError` if it cannot run here)."""

    # -- KVBackend --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.control.address

    def _register_pools(self, pools: KVPools) -> None:
        self.engine.register([*pools.kv, *pools.aux])

    def _session(self) -> tuple[dict[str, Any], bytes | None]:
        assert self.pools is not None
        fields, blob = self.engine.session()
        return {**fields, "pools": _pools_fields(self.pools)}, blob

    def _bootstrap(self, handle: TransferHandle, peer: str) -> None:
        if self.role is Role.RECEIVER:
            self._bootstrap_receiver(handle, peer)
        else:
            self._bootstrap_sender(handle)

    def _stop(self, handle: TransferHandle) -> None:
        if self.role is Role.RECEIVER:
            self._stop_receiver(handle)
        else:
            self._stop_sender(handle)

    def _forget(self, handle: TransferHandle) -> None:
        with self._lock:
            if self.role is Role.RECEIVER:
                token = self._recv_token_of.pop((handle.room, handle.generation), None)
                rec = None if token is None else self._recv_by_token.pop(token, None)
                if token is not None:
                    self._expecting.discard(token)
                if rec is not None:
                    peer = self._peers.get(rec.peer)
                    if peer is not None:
                        peer.rooms.discard(rec.token)
            else:
                unclaimed = self._waiting.pop(handle.room, None)
                if unclaimed is handle and handle.state is KVPoll.Failed:
                    # Closed before its decode's pages arrived: answer them with this failure
                    # when they do, rather than leaving the decode waiting for its deadline.
                    self._closed_unclaimed[handle.room] = (time.monotonic(), handle.reason)
                    while len(self._closed_unclaimed) > _MAX_TOMBSTONES:
                        self._closed_unclaimed.popitem(last=False)
                send_room = self._send_by_room.get(handle.room)
                if send_room is not None and send_room.handle is handle:
                    # The worker keeps its own reference until the room's writes ended.
                    del self._send_by_room[handle.room]

    def _shutdown(self) -> None:
        if self._worker is not None:
            self._work.put(("exit", None))
            self._worker.join(5.0)
        self.control.stop()
        self.engine.close()

    # -- receiver (decode) -----------------------------------------------------------------

    def _bootstrap_receiver(self, handle: TransferHandle, peer_addr: str) -> None:
        token = uuid.uuid4().hex
        rec = _RecvRoom(handle, token, peer_addr)
        hello = False
        with self._lock:
            self._recv_by_token[token] = rec
            self._recv_token_of[(handle.room, handle.generation)] = token
            peer = self._peers.get(peer_addr)
            if peer is None:
                peer = self._peers[peer_addr] = _Peer(peer_addr)
                hello = True
            peer.rooms.add(token)
            answered, refused = peer.answered, peer.refused
        if hello:
            fields, blob = self._session()
            self.control.watch(peer_addr)
            self.control.send(
                peer_addr, "HELLO", {"role": self.role.value, "engine": self.name, "session": fields}, blob
            )
        if refused is not None:
            handle.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, f"prefill at {peer_addr}: {refused}"))
        elif answered:
            handle.bootstrapped()

    def _expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        with self._lock:
            rec = self._recv_room_of(handle)
            if rec is None:
                raise BackendError(f"room {handle.room!r}: expect() before bootstrap()")
            rec.pages, rec.aux = pages, aux_index
            peer = self._peers.get(rec.peer)
            ready = peer is not None and peer.answered
        if ready:
            self._send_room_pages(rec)

    def _recv_room_of(self, handle: TransferHandle) -> _RecvRoom | None:
        token = self._recv_token_of.get((handle.room, handle.generation))
        return None if token is None else self._recv_by_token.get(token)

    def _send_room_pages(self, rec: _RecvRoom) -> None:
        if rec.pages_sent or rec.pages is None or rec.handle.is_terminal:
            return
        rec.pages_sent = True
        self._expecting.add(rec.token)
        self.control.send(
            rec.peer, "ROOM", {"room": rec.handle.room, "token": rec.token, "pages": rec.pages, "aux": rec.aux}
        )

    def _stop_receiver(self, handle: TransferHandle) -> None:
        with self._lock:
            rec = self._recv_room_of(handle)
            peer = None if rec is None else self._peers.get(rec.peer)
        if rec is None:
            handle.writes_drained()
            return
        self._expecting.discard(rec.token)
        reason = handle.reason
        if peer is not None and peer.answered and not (reason is not None and reason.from_peer):
            self._send_abort(rec.peer, handle.room, rec.token, reason)
        if not rec.pages_sent:
            # The prefill never learnt where to write: nothing of it can land here.
            handle.writes_drained()
        # Otherwise ABORT_ACK (or the drain deadline) opens the release gate.

    def _receiver_progress(self, token: str, nbytes: int, last: bool) -> None:
        rec = self._recv_by_token.get(token)
        if rec is None:
            self.remote_stats.stale_messages += 1
            logger.debug("kvfsm %s: progress for unknown token %s dropped", self.name, token[:8])
            return
        handle = rec.handle
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()
        handle.chunk_done(nbytes, last=last)
        if last:
            handle.transfer_done()
            self._expecting.discard(token)

    def _on_tick(self) -> float | None:
        """Poll the engine's notifications; ask for quick turns while data is expected.

        Polling is also what makes a progress-thread-less engine (NIXL here)
        receive: the faster we poll while a transfer is on, the sooner it lands.
        """
        now = time.monotonic()
        notes = self.engine.receiver_notifications()
        for message in notes:
            parsed = _parse_notification(message)
            if parsed is None:
                self.remote_stats.stale_messages += 1
                logger.warning("kvfsm %s: malformed engine notification %r dropped", self.name, message[:64])
                continue
            self._receiver_progress(*parsed)
        if notes:
            self._busy_until = now + _BUSY_SPAN
        return _BUSY_TICK if (self._expecting or now < self._busy_until) else None

    # -- sender (prefill) -------------------------------------------------------------------

    def _bootstrap_sender(self, handle: TransferHandle) -> None:
        now = time.monotonic()
        attached: _SendRoom | None = None
        aborted: ControlMessage | None = None
        with self._lock:
            self._expire_pending(now)
            pending = self._pending.pop(handle.room, None)
            if pending is None:
                self._waiting[handle.room] = handle
            else:
                _, send_room, message = pending
                if send_room is None:
                    aborted = message
                else:
                    send_room.handle = handle
                    self._send_by_room[handle.room] = send_room
                    attached = send_room
        if aborted is not None:
            handle.fail(_peer_reason(aborted))
        elif attached is not None:
            handle.bootstrapped()

    def _expire_pending(self, now: float) -> None:
        ttl = self.config.pending_ttl
        for room in [room for room, (t, _, _) in self._pending.items() if now - t > ttl]:
            del self._pending[room]

    def _send(self, handle: TransferHandle, pages: list[int], last: bool, aux_index: int | None) -> None:
        with self._lock:
            send_room = self._send_by_room.get(handle.room)
            if send_room is not None and send_room.handle is not handle:
                send_room = None
            if send_room is not None:
                start = send_room.cursor
                end = start + len(pages)
                if end > len(send_room.pages) or (last and end != len(send_room.pages)):
                    problem = (
                        f"the decode expects {len(send_room.pages)} pages; this chunk would bring the total to {end}"
                        + (" and it is the last" if last else "")
                    )
                else:
                    problem = None
                    send_room.cursor = end
                    dst = send_room.pages[start:end]
        if send_room is None:
            # Not bootstrapped: the table decides (transfer_started out of order fails the room closed).
            handle.transfer_started()
            return
        if problem is not None:
            self._reject(handle, problem)
        assert self.pools is not None
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()
        nbytes = len(pages) * self.pools.page_nbytes
        self._work.put(("chunk", (send_room, _Chunk(pages, dst, last, aux_index, nbytes))))

    def _stop_sender(self, handle: TransferHandle) -> None:
        unclaimed: _SendRoom | None = None
        with self._lock:
            # A room still waiting for its decode stays in _waiting (until closed), so a
            # ROOM arriving later is answered with this failure instead of hanging the decode.
            send_room = self._send_by_room.get(handle.room)
            if send_room is None or send_room.handle is not handle:
                send_room = None
                pending = self._pending.get(handle.room)
                if pending is not None and pending[1] is not None:
                    # The decode's metadata arrived but this room failed before bootstrap() claimed it.
                    unclaimed = pending[1]
                    del self._pending[handle.room]
        if send_room is None:
            handle.writes_drained()
            if unclaimed is not None:
                self._send_abort(unclaimed.peer, handle.room, unclaimed.token, handle.reason)
                self._send_ack(unclaimed)
            return
        reason = handle.reason
        if not (reason is not None and reason.from_peer):
            self._send_abort(send_room.peer, handle.room, send_room.token, reason)
        self._work.put(("stop", send_room))

    def _send_abort(self, addr: str, room: Hashable, token: str | None, reason: FailureReason | None) -> None:
        if addr not in self._peers:
            return  # lost or never met: nobody to tell (and no socket to reopen for it)
        kind = reason.kind.value if reason is not None else FailureKind.ABORTED.value
        text = reason.message if reason is not None else "aborted"
        self.remote_stats.aborts_sent += 1
        self.control.send(addr, "ABORT", {"room": room, "token": token, "kind": kind, "message": text})

    def _send_ack(self, send_room: _SendRoom) -> None:
        if send_room.peer not in self._peers:
            return
        self.remote_stats.abort_acks_sent += 1
        self.control.send(send_room.peer, "ABORT_ACK", {"room": send_room.room, "token": send_room.token})

    # -- the writer thread (sender) ----------------------------------------------------------------

    def _work_loop(self) -> None:
        active: dict[str, _SendRoom] = {}
        while True:
            try:
                block = not active
                while True:
                    try:
                        command, payload = self._work.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    if command == "exit":
                        self._abandon(active)
                        return
                    self._command(command, payload, active)
                moved = False
                for token, send_room in list(active.items()):
                    moved |= self._progress(send_room)
                    if not send_room.chunks and not send_room.jobs_inflight:
                        del active[token]
                if active and not moved:
                    time.sleep(self.config.poll_interval)
            except Exception:
                logger.exception("kvfsm %s writer thread: unexpected error; it goes on", self.name)
                time.sleep(0.01)

    def _command(self, command: str, payload: Any, active: dict[str, _SendRoom]) -> None:
        if command == "chunk":
            send_room, chunk = payload
            if send_room.stopped:
                return
            send_room.chunks.append(chunk)
            active[send_room.token] = send_room
        elif command == "stop":
            send_room = payload
            if not send_room.stopped:
                send_room.stopped = True
                send_room.chunks.clear()
                still = []
                for job in send_room.jobs_inflight:
                    if job.cancel():
                        job.release()
                    else:
                        still.append(job)
                send_room.jobs_inflight = still
            active[send_room.token] = send_room

    def _abandon(self, active: dict[str, _SendRoom]) -> None:
        for send_room in active.values():
            for job in send_room.jobs_inflight:
                job.cancel()

    def _poll_jobs(self, send_room: _SendRoom, jobs: list[EngineJob]) -> tuple[list[EngineJob], str | None]:
        """Poll `jobs`; return those still running and the first failure detail (if any)."""
        running: list[EngineJob] = []
        failure: str | None = None
        for job in jobs:
            status = job.poll()
            if status == "pending":
                running.append(job)
            elif status == "timeout":
                # Mooncake's TIMEOUT is derived at read time and not sticky: the write
                # goes on and may still complete. Count it; keep the job in flight so
                # drain stays truthful; the lifecycle's transferring deadline decides.
                send_room.timeouts_seen += 1
                self.remote_stats.engine_timeouts += 1
                if self._timeout_fails():
                    failure = failure or f"{self.name} reported TIMEOUT for a write ({job.detail})"
                running.append(job)
            elif status == "failed":
                self.remote_stats.engine_failures += 1
                send_room.undrained |= job.may_still_land
                job.release()
                failure = failure or f"{self.name} write failed ({job.detail})"
            else:
                job.release()
        return running, failure

    def _timeout_fails(self) -> bool:
        return False

    def _progress(self, send_room: _SendRoom) -> bool:
        handle = send_room.handle
        before = len(send_room.jobs_inflight)
        send_room.jobs_inflight, failure = self._poll_jobs(send_room, send_room.jobs_inflight)
        moved = len(send_room.jobs_inflight) != before
        if send_room.stopped:
            if not send_room.jobs_inflight:
                send_room.chunks.clear()
                if send_room.undrained:
                    logger.warning(
                        "kvfsm %s room %r: a failed write may still land; no ABORT_ACK, the drain deadline decides",
                        self.name,
                        send_room.room,
                    )
                    return True
                if handle is not None:
                    handle.writes_drained()
                self._send_ack(send_room)
                return True
            return moved
        if failure is not None and handle is not None:
            if not send_room.failed_sent:
                # Once: the stop command this triggers may reach the queue a turn later.
                send_room.failed_sent = True
                handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, failure))
            return True
        peer = self._peers.get(send_room.peer)
        if peer is None or peer.pools is None or handle is None:
            return moved
        for chunk in send_room.chunks:
            if not chunk.submitted:
                chunk.submitted = True
                writes = self._kv_writes(peer.pools, chunk)
                # With a notifying engine, a middle chunk's notification is its progress notice.
                note = None
                if self.engine.notifies_receiver and not chunk.last:
                    note = _notification(send_room.token, chunk.nbytes, last=False)
                if writes:
                    job = self._submit(send_room, peer, writes, note)
                    if job is None:
                        return True
                    chunk.jobs.append(job)
                elif note is not None and not self._notify(send_room, peer, note):
                    return True
                moved = True
        while send_room.chunks:
            chunk = send_room.chunks[0]
            chunk.jobs = [j for j in chunk.jobs if j in send_room.jobs_inflight]
            if chunk.jobs:
                break
            if not chunk.last:
                send_room.chunks.popleft()
                handle.chunk_done(chunk.nbytes)
                if not self.engine.notifies_receiver:
                    self._notice(send_room, "CHUNK", {"nbytes": chunk.nbytes, "last": False})
                moved = True
                continue
            if chunk.tail is None and not self._start_tail(peer, send_room, chunk):
                return True
            if chunk.tail is not None and chunk.tail in send_room.jobs_inflight:
                break
            send_room.chunks.popleft()
            handle.chunk_done(chunk.nbytes, last=True)
            handle.transfer_done()
            if not self.engine.notifies_receiver:
                self._notice(send_room, "DONE", {"nbytes": chunk.nbytes})
            moved = True
        return moved

    def _start_tail(self, peer: _Peer, send_room: _SendRoom, chunk: _Chunk) -> bool:
        """Issue the commit marker of the last chunk; False if that failed (the room failed)."""
        assert self.pools is not None
        assert peer.pools is not None
        note = _notification(send_room.token, chunk.nbytes, last=True) if self.engine.notifies_receiver else None
        aux_writes: list[Write] = []
        if chunk.aux_src is not None and send_room.aux is not None:
            for mine, theirs in zip(self.pools.aux, peer.pools.aux, strict=True):
                aux_writes.append(
                    (
                        mine.ptr + chunk.aux_src * mine.page_nbytes,
                        theirs.ptr + send_room.aux * theirs.page_nbytes,
                        mine.page_nbytes,
                    )
                )
        if aux_writes:
            job = self._submit(send_room, peer, aux_writes, note)
            if job is None:
                return False
            chunk.tail = job
        elif note is not None:
            if not self._notify(send_room, peer, note):
                return False
            chunk.tail = _DoneJob()
        else:
            chunk.tail = _DoneJob()
        return True

    def _notify(self, send_room: _SendRoom, peer: _Peer, note: bytes) -> bool:
        try:
            self.engine.notify(peer.target, note)
        except Exception as exc:
            self._engine_error(send_room, f"{self.name} notification failed: {exc}")
            return False
        return True

    def _submit(self, send_room: _SendRoom, peer: _Peer, writes: list[Write], note: bytes | None) -> EngineJob | None:
        try:
            job = self.engine.submit(peer.target, writes, note)
        except Exception as exc:
            if isinstance(exc, PartialSubmit):
                send_room.jobs_inflight.append(exc.job)
            logger.warning("kvfsm %s: submitting %d writes failed: %s", self.name, len(writes), exc)
            self._engine_error(send_room, f"{self.name} submit failed: {exc}")
            return None
        self.remote_stats.jobs_submitted += 1
        self.remote_stats.writes_submitted += len(writes)
        send_room.jobs_inflight.append(job)
        return job

    def _engine_error(self, send_room: _SendRoom, message: str) -> None:
        self.remote_stats.engine_failures += 1
        if send_room.handle is not None and not send_room.failed_sent:
            send_room.failed_sent = True
            send_room.handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, message))

    def _kv_writes(self, peer_pools: KVPools, chunk: _Chunk) -> list[Write]:
        assert self.pools is not None
        writes: list[Write] = []
        for src, dst, count in coalesce_runs(chunk.src, chunk.dst):
            for mine, theirs in zip(self.pools.kv, peer_pools.kv, strict=True):
                writes.append(
                    (mine.ptr + src * mine.page_nbytes, theirs.ptr + dst * theirs.page_nbytes, count * mine.page_nbytes)
                )
        return writes

    def _notice(self, send_room: _SendRoom, kind: str, fields: dict[str, Any]) -> None:
        assert send_room.handle is not None
        self.control.send(send_room.peer, kind, {"room": send_room.handle.room, "token": send_room.token, **fields})

    # -- control-plane messages (control thread) -------------------------------------------------

    def _on_message(self, message: ControlMessage) -> None:
        handler = _HANDLERS.get((self.role, message.type))
        if handler is None:
            self.remote_stats.stale_messages += 1
            logger.warning(
                "kvfsm %s %s: unexpected %s from %s dropped", self.name, self.role.value, message.type, message.addr
            )
            return
        handler(self, message)

    def _on_hello(self, message: ControlMessage) -> None:
        problem = None
        try:
            pools = _pools_from_fields(message["session"].get("pools"))
        except (TypeError, ValueError) as exc:
            pools, problem = None, f"bad session: {exc}"
        if problem is None and message["engine"] != self.name:
            problem = f"engine {message['engine']!r} cannot talk to this {self.name!r} endpoint"
        if problem is None and self.pools is not None and pools is not None:
            problem = self.pools.layout_mismatch(pools)
        target = None
        if problem is None:
            try:
                target = self.engine.add_peer(message["session"], message.blob)
            except Exception as exc:
                problem = f"{self.name} could not open the peer's session: {exc}"
        with self._lock:
            old = self._peers.get(message.addr)
            if old is not None and old.target is not None:
                self.engine.remove_peer(old.target)
            peer = self._peers[message.addr] = _Peer(message.addr)
            peer.pools, peer.target, peer.answered = pools, target, problem is None
        if problem is not None:
            logger.warning("kvfsm %s: HELLO from %s refused: %s", self.name, message.addr, problem)
        self.control.watch(message.addr)
        fields, blob = self._session()
        if problem is not None:
            fields = {**fields, "refused": problem}
        self.control.send(
            message.addr, "HELLO_ACK", {"role": self.role.value, "engine": self.name, "session": fields}, blob
        )

    def _on_hello_ack(self, message: ControlMessage) -> None:
        session = message["session"]
        problem = session.get("refused") if isinstance(session.get("refused"), str) else None
        pools = None
        if problem is None:
            try:
                pools = _pools_from_fields(session.get("pools"))
            except (TypeError, ValueError) as exc:
                problem = f"bad session from the prefill: {exc}"
        if problem is None and self.pools is not None and pools is not None:
            problem = self.pools.layout_mismatch(pools)
        with self._lock:
            peer = self._peers.get(message.addr)
            if peer is None or peer.answered or peer.refused is not None:
                # Unasked for, or a repeat: the handshake of this peer is settled already.
                self.remote_stats.stale_messages += 1
                return
            if problem is None:
                peer.answered, peer.pools = True, pools
            else:
                peer.refused = problem
            recs = [self._recv_by_token[t] for t in peer.rooms if t in self._recv_by_token]
        for rec in recs:
            handle = rec.handle
            if problem is not None:
                handle.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, f"prefill at {message.addr}: {problem}"))
            elif handle.state is KVPoll.Bootstrapping:
                handle.bootstrapped()
                self._send_room_pages(rec)
            elif handle.state is KVPoll.Failed and not (handle.reason is not None and handle.reason.from_peer):
                # It failed while the handshake was in flight: tell the prefill now, so its
                # side of the room does not wait for its bootstrap deadline.
                self._send_abort(rec.peer, handle.room, rec.token, handle.reason)

    def _on_room(self, message: ControlMessage) -> None:
        room, token, pages, aux = message["room"], message["token"], message["pages"], message["aux"]
        with self._lock:
            peer = self._peers.get(message.addr)
            problem = None
            if peer is None or not peer.answered or peer.pools is None:
                problem = "ROOM from a decode that did not complete the handshake"
            elif any(p >= peer.pools.num_pages for p in pages):
                problem = f"destination page out of range (the decode pool has {peer.pools.num_pages} pages)"
            elif aux is not None and aux >= peer.pools.num_aux_slots:
                problem = f"aux slot {aux} out of range (the decode has {peer.pools.num_aux_slots})"
            existing = self._send_by_room.get(room)
            if (
                problem is None
                and existing is not None
                and existing.handle is not None
                and not existing.handle.is_terminal
            ):
                problem = f"room {room!r} is already in use by another transfer on this prefill"
                self.remote_stats.duplicate_rooms += 1
            if problem is None and room in self._pending and self._pending[room][1] is not None:
                problem = f"room {room!r} already has pending metadata from a decode"
                self.remote_stats.duplicate_rooms += 1
            handle = None
            failed_first: FailureReason | None = None
            if problem is None:
                send_room = _SendRoom(room, None, token, message.addr, list(pages), aux)
                handle = self._waiting.pop(room, None)
                tombstone = self._closed_unclaimed.pop(room, None) if handle is None else None
                if handle is not None and handle.is_terminal:
                    failed_first = handle.reason
                    handle = None
                elif tombstone is not None and time.monotonic() - tombstone[0] <= self.config.pending_ttl:
                    failed_first = tombstone[1] or FailureReason(
                        FailureKind.ABORTED, "closed before the decode's pages arrived"
                    )
                elif handle is None:
                    self._expire_pending(time.monotonic())
                    self._pending[room] = (time.monotonic(), send_room, message)
                else:
                    send_room.handle = handle
                    self._send_by_room[room] = send_room
        if problem is not None:
            self.remote_stats.rejected_rooms += 1
            logger.warning("kvfsm %s: ROOM %r from %s refused: %s", self.name, room, message.addr, problem)
            self.control.send(
                message.addr,
                "ABORT",
                {"room": room, "token": token, "kind": FailureKind.BOOTSTRAP_ERROR.value, "message": problem},
            )
            self.control.send(message.addr, "ABORT_ACK", {"room": room, "token": token})
            return
        if failed_first is not None:
            # This prefill gave up on the room before the decode's pages arrived.
            self._send_abort(message.addr, room, token, failed_first)
            self.remote_stats.abort_acks_sent += 1
            self.control.send(message.addr, "ABORT_ACK", {"room": room, "token": token})
            return
        if handle is not None:
            handle.bootstrapped()

    def _on_abort_at_sender(self, message: ControlMessage) -> None:
        room, token = message["room"], message["token"]
        with self._lock:
            send_room = self._send_by_room.get(room)
            if send_room is not None and send_room.token != token:
                # The room id is live here for another transfer: this ABORT does not name it.
                self.remote_stats.stale_messages += 1
                logger.warning(
                    "kvfsm %s: ABORT for room %r with a stale token from %s dropped", self.name, room, message.addr
                )
                return
            waiting = self._waiting.pop(room, None) if send_room is None else None
            if send_room is None and waiting is None:
                # Not claimed here yet (or only its metadata is): remember the abort, so a
                # later bootstrap() of this room fails at once.
                self._pending[room] = (time.monotonic(), None, message)
        if send_room is not None:
            handle = send_room.handle
            if handle is not None and not handle.is_terminal:
                handle.fail(_peer_reason(message))  # -> _stop_sender -> worker drains -> ABORT_ACK
            else:
                # Terminal or closed: ACK once whatever it issued has ended.
                self._work.put(("stop", send_room))
            return
        if waiting is not None:
            waiting.fail(_peer_reason(message))
        # Nothing was written for it: the decode may release at once.
        self.remote_stats.abort_acks_sent += 1
        self.control.send(message.addr, "ABORT_ACK", {"room": room, "token": token})

    def _on_abort_at_receiver(self, message: ControlMessage) -> None:
        rec = self._recv_by_token.get(message["token"] or "")
        if rec is None or rec.handle.room != message["room"]:
            self.remote_stats.stale_messages += 1
            return
        rec.handle.fail(_peer_reason(message))

    def _on_abort_ack(self, message: ControlMessage) -> None:
        rec = self._recv_by_token.get(message["token"] or "")
        if rec is None:
            self.remote_stats.stale_messages += 1
            return
        self.remote_stats.abort_acks_received += 1
        rec.handle.writes_drained()

    def _on_chunk(self, message: ControlMessage) -> None:
        if self._check_room_token(message):
            self._receiver_progress(message["token"], message["nbytes"], message["last"])

    def _on_done(self, message: ControlMessage) -> None:
        if self._check_room_token(message):
            self._receiver_progress(message["token"], message["nbytes"], True)

    def _check_room_token(self, message: ControlMessage) -> bool:
        rec = self._recv_by_token.get(message["token"])
        if rec is None or rec.handle.room != message["room"] or rec.peer != message.addr:
            self.remote_stats.stale_messages += 1
            logger.debug(
                "kvfsm %s: %s for room %r with a stale token dropped", self.name, message.type, message["room"]
            )
            return False
        return True

    def _on_peer_lost(self, addr: str, peer_id: str | None, why: str) -> None:
        self.remote_stats.peers_lost += 1
        victims: list[tuple[TransferHandle, bool]] = []
        with self._lock:
            peer = self._peers.pop(addr, None)
            answered = peer is not None and peer.answered
            if self.role is Role.RECEIVER:
                tokens = peer.rooms if peer is not None else set()
                victims = [(self._recv_by_token[t].handle, answered) for t in tokens if t in self._recv_by_token]
            else:
                victims = [
                    (r.handle, True) for r in self._send_by_room.values() if r.peer == addr and r.handle is not None
                ]
                for room in [room for room, (_, r, m) in self._pending.items() if m.addr == addr]:
                    del self._pending[room]
        if peer is not None and peer.target is not None:
            self.engine.remove_peer(peer.target)
        for handle, was_answered in victims:
            if handle.state in TERMINAL or handle.closed:
                continue
            if was_answered:
                reason = FailureReason(FailureKind.PEER_LOST, f"peer {addr} lost: {why}")
            else:
                reason = FailureReason(
                    FailureKind.BOOTSTRAP_ERROR, f"prefill at {addr} never answered the handshake: {why}"
                )
            handle.fail(reason)


class _DoneJob(EngineJob):
    """A commit marker that needed no write (no aux slot, nothing to notify)."""

    def poll(self) -> str:
        return "done"


_NOTIFY_PREFIX = b"kvfsm1|"


def _notification(token: str, nbytes: int, *, last: bool) -> bytes:
    """The engine notification of a chunk: `kvfsm1|<token>|<nbytes>|<0 or 1 for last>`."""
    return _NOTIFY_PREFIX + f"{token}|{nbytes}|{int(last)}".encode()


def _parse_notification(message: bytes) -> tuple[str, int, bool] | None:
    if not message.startswith(_NOTIFY_PREFIX):
        return None
    try:
        token, nbytes, last = message[len(_NOTIFY_PREFIX) :].decode().split("|")
        if last not in ("0", "1") or int(nbytes) < 0:
            return None
        return token, int(nbytes), last == "1"
    except (UnicodeDecodeError, ValueError):
        return None


def _peer_reason(message: ControlMessage) -> FailureReason:
    try:
        kind = FailureKind(message["kind"])
    except ValueError:
        kind = FailureKind.PEER_FAILED
    text = f"peer {message.addr}: {message['message']}"
    if kind in (FailureKind.ABORTED, FailureKind.BOOTSTRAP_ERROR):
        return FailureReason(kind, text, from_peer=True)
    return FailureReason(FailureKind.PEER_FAILED, f"{text} ({kind.value})", from_peer=True)


_HANDLERS = {
    (Role.SENDER, "HELLO"): RemoteBackend._on_hello,
    (Role.SENDER, "ROOM"): RemoteBackend._on_room,
    (Role.SENDER, "ABORT"): RemoteBackend._on_abort_at_sender,
    (Role.RECEIVER, "HELLO_ACK"): RemoteBackend._on_hello_ack,
    (Role.RECEIVER, "CHUNK"): RemoteBackend._on_chunk,
    (Role.RECEIVER, "DONE"): RemoteBackend._on_done,
    (Role.RECEIVER, "ABORT"): RemoteBackend._on_abort_at_receiver,
    (Role.RECEIVER, "ABORT_ACK"): RemoteBackend._on_abort_ack,
}
