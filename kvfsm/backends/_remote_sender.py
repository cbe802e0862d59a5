"""The prefill (sender) half of a remote endpoint, and its writer thread.

A prefill endpoint answers each decode's HELLO, matches the decode's ROOM
(destination pages, aux slot, token) with its scheduler's `bootstrap()`
in whichever order they come, and hands each `send()` chunk to one writer
thread. That thread turns chunks into engine writes over coalesced page
runs, polls them, reports `chunk_done`/`transfer_done`, writes the last
chunk's commit marker (aux slot or notification) only after every KV write
landed, and tells the decode (CHUNK/DONE, unless the engine notifies it).
When a room fails it stops issuing writes, waits until none is in flight
(cancelling where the engine can), then reports `writes_drained` and sends
ABORT_ACK, so the decode may reuse its pages.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll
from ._remote_engine import DoneJob, EngineJob, PartialSubmit, Write, coalesce_runs
from ._remote_wire import PeerRecord, RemoteEndpoint, notification, peer_reason, pools_from_fields
from .base import KVPools
from .control import ControlMessage

__all__ = ["SenderSide"]

logger = logging.getLogger("kvfsm.backends.remote")

#: Closed-before-claimed rooms a prefill remembers (bounded memory).
_MAX_TOMBSTONES = 65536


class Chunk:
    """One `send()` call: its source and destination pages, and the engine jobs writing them."""

    __slots__ = ("aux_src", "dst", "jobs", "last", "nbytes", "src", "submitted", "tail")

    def __init__(self, src: list[int], dst: list[int], last: bool, aux_src: int | None, nbytes: int) -> None:
        self.src, self.dst, self.last, self.aux_src, self.nbytes = src, dst, last, aux_src, nbytes
        self.jobs: list[EngineJob] = []
        self.submitted = False
        # The last chunk's commit marker (aux write or notification) goes out after every KV write landed.
        self.tail: EngineJob | None = None


class SendRoom:
    """One prefill room as the decode described it (token, pages, aux) and what the writer did for it."""

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
        self.chunks: deque[Chunk] = deque()
        self.jobs_inflight: list[EngineJob] = []
        self.stopped = False
        self.failed_sent = False
        self.timeouts_seen = 0
        self.undrained = False


class SenderSide(RemoteEndpoint):
    """Bootstrap, send, stop, the control messages and the writer thread of a prefill endpoint."""

    _send_by_room: dict[Hashable, SendRoom]
    _waiting: dict[Hashable, TransferHandle]
    _pending: dict[Hashable, tuple[float, SendRoom | None, ControlMessage]]
    _closed_unclaimed: OrderedDict[Hashable, tuple[float, FailureReason | None]]
    _work: queue.SimpleQueue[tuple[str, Any]]

    def _init_sender(self) -> None:
        self._send_by_room = {}
        self._waiting = {}
        self._pending = {}
        self._closed_unclaimed = OrderedDict()
        self._work = queue.SimpleQueue()

    def _forget_sender(self, handle: TransferHandle) -> None:
        with self._lock:
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

    def _sender_rooms_of(self, addr: str) -> list[tuple[TransferHandle, bool]]:
        """The live rooms with a lost decode (under the lock); its early metadata is dropped."""
        victims = [(r.handle, True) for r in self._send_by_room.values() if r.peer == addr and r.handle is not None]
        for room in [room for room, (_, r, m) in self._pending.items() if m.addr == addr]:
            del self._pending[room]
        return victims

    def _bootstrap_sender(self, handle: TransferHandle) -> None:
        now = time.monotonic()
        attached: SendRoom | None = None
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
            handle.fail(peer_reason(aborted))
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
        self._work.put(("chunk", (send_room, Chunk(pages, dst, last, aux_index, nbytes))))

    def _stop_sender(self, handle: TransferHandle) -> None:
        unclaimed: SendRoom | None = None
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

    def _send_ack(self, send_room: SendRoom) -> None:
        if send_room.peer not in self._peers:
            return
        self.remote_stats.abort_acks_sent += 1
        self.control.send(send_room.peer, "ABORT_ACK", {"room": send_room.room, "token": send_room.token})

    # -- the writer thread (sender) ----------------------------------------------------------------

    def _work_loop(self) -> None:
        active: dict[str, SendRoom] = {}
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

    def _command(self, command: str, payload: Any, active: dict[str, SendRoom]) -> None:
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

    def _abandon(self, active: dict[str, SendRoom]) -> None:
        for send_room in active.values():
            for job in send_room.jobs_inflight:
                job.cancel()

    def _poll_jobs(self, send_room: SendRoom, jobs: list[EngineJob]) -> tuple[list[EngineJob], str | None]:
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

    def _progress(self, send_room: SendRoom) -> bool:
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
                    note = notification(send_room.token, chunk.nbytes, last=False)
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

    def _start_tail(self, peer: PeerRecord, send_room: SendRoom, chunk: Chunk) -> bool:
        """Issue the commit marker of the last chunk; False if that failed (the room failed)."""
        assert self.pools is not None
        assert peer.pools is not None
        note = notification(send_room.token, chunk.nbytes, last=True) if self.engine.notifies_receiver else None
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
            chunk.tail = DoneJob()
        else:
            chunk.tail = DoneJob()
        return True

    def _notify(self, send_room: SendRoom, peer: PeerRecord, note: bytes) -> bool:
        try:
            self.engine.notify(peer.target, note)
        except Exception as exc:
            self._engine_error(send_room, f"{self.name} notification failed: {exc}")
            return False
        return True

    def _submit(
        self, send_room: SendRoom, peer: PeerRecord, writes: list[Write], note: bytes | None
    ) -> EngineJob | None:
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

    def _engine_error(self, send_room: SendRoom, message: str) -> None:
        self.remote_stats.engine_failures += 1
        if send_room.handle is not None and not send_room.failed_sent:
            send_room.failed_sent = True
            send_room.handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, message))

    def _kv_writes(self, peer_pools: KVPools, chunk: Chunk) -> list[Write]:
        assert self.pools is not None
        writes: list[Write] = []
        for src, dst, count in coalesce_runs(chunk.src, chunk.dst):
            for mine, theirs in zip(self.pools.kv, peer_pools.kv, strict=True):
                writes.append(
                    (mine.ptr + src * mine.page_nbytes, theirs.ptr + dst * theirs.page_nbytes, count * mine.page_nbytes)
                )
        return writes

    def _notice(self, send_room: SendRoom, kind: str, fields: dict[str, Any]) -> None:
        assert send_room.handle is not None
        self.control.send(send_room.peer, kind, {"room": send_room.handle.room, "token": send_room.token, **fields})

    def _on_hello(self, message: ControlMessage) -> None:
        problem = None
        try:
            pools = pools_from_fields(message["session"].get("pools"))
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
            peer = self._peers[message.addr] = PeerRecord(message.addr)
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
                send_room = SendRoom(room, None, token, message.addr, list(pages), aux)
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
                handle.fail(peer_reason(message))  # -> _stop_sender -> worker drains -> ABORT_ACK
            else:
                # Terminal or closed: ACK once whatever it issued has ended.
                self._work.put(("stop", send_room))
            return
        if waiting is not None:
            waiting.fail(peer_reason(message))
        # Nothing was written for it: the decode may release at once.
        self.remote_stats.abort_acks_sent += 1
        self.control.send(message.addr, "ABORT_ACK", {"room": room, "token": token})
