"""The prefill's writer thread: engine writes of each room's chunks, polled until they end.

`send()` and the stop of a failed room only queue a command; one thread
per prefill endpoint turns chunks into engine writes over coalesced page
runs, polls them, reports `chunk_done`/`transfer_done`, writes the last
chunk's commit marker (the aux slot) only after every KV write landed,
and tells the decode (CHUNK/DONE, unless the engine's notification rides
on a write). A stopped room issues nothing more; once none of its writes
is in flight (cancelled where the engine can) it reports `writes_drained`
and sends ABORT_ACK, so the decode may reuse its pages. Living apart from
the control messages (`_remote_sender`), it is the only code that talks to
the engine's jobs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason
from ._remote_engine import DoneJob, EngineJob, PartialSubmit, Write, coalesce_runs, page_writes
from ._remote_wire import PeerRecord, RemoteEndpoint, notification

__all__ = ["Chunk", "SendRoom", "WriterThread"]

logger = logging.getLogger("kvfsm.backends.remote")


class Chunk:
    """One `send()` call: its source and destination pages, and the engine jobs writing them."""

    __slots__ = ("aux_src", "dst", "jobs", "last", "nbytes", "src", "submitted", "tail")

    def __init__(self, src: list[int], dst: list[int], last: bool, aux_src: int | None, nbytes: int) -> None:
        self.src, self.dst, self.last, self.aux_src, self.nbytes = src, dst, last, aux_src, nbytes
        self.jobs: list[EngineJob] = []
        self.submitted = False
        # The last chunk's commit marker (an aux write) goes out after every KV write landed.
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
        "peer_aborted",
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
        # Set when the decode's ABORT failed this room: it knows, so no ABORT goes back.
        self.peer_aborted = False


class WriterThread(RemoteEndpoint):
    """The writer thread of a prefill endpoint and the engine calls it makes."""

    _work: queue.SimpleQueue[tuple[str, Any]]
    _worker: threading.Thread | None

    def _start_writer(self) -> None:
        self._worker = threading.Thread(target=self._work_loop, name=f"kvfsm-{self.name}-writer", daemon=True)
        self._worker.start()

    def _stop_writer(self) -> None:
        if self._worker is not None:
            self._work.put(("exit", None))
            self._worker.join(5.0)

    def _send_ack(self, send_room: SendRoom) -> None:
        if send_room.peer not in self._peers:
            return
        self.remote_stats.abort_acks_sent += 1
        self.control.send(send_room.peer, "ABORT_ACK", {"room": send_room.room, "token": send_room.token})

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
        assert self.pools is not None
        for chunk in send_room.chunks:
            if not chunk.submitted:
                chunk.submitted = True
                writes = page_writes(self.pools.kv, peer.pools.kv, coalesce_runs(chunk.src, chunk.dst))
                # A middle chunk's engine notification is its progress notice; the last
                # chunk's rides on its commit marker (_start_tail).
                note = None
                if not chunk.last and self._notice_rides_on_write(send_room, chunk):
                    note = notification(send_room.token, chunk.nbytes, last=False)
                job = self._issue(send_room, peer, writes, note)
                if job is None:
                    return True
                chunk.jobs.append(job)
                moved = True
        while send_room.chunks:
            chunk = send_room.chunks[0]
            chunk.jobs = [j for j in chunk.jobs if j in send_room.jobs_inflight]
            if chunk.jobs:
                break
            if not chunk.last:
                send_room.chunks.popleft()
                handle.chunk_done(chunk.nbytes)
                if not self._notice_rides_on_write(send_room, chunk):
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
            if not self._notice_rides_on_write(send_room, chunk):
                self._notice(send_room, "DONE", {"nbytes": chunk.nbytes})
            moved = True
        return moved

    def _notice_rides_on_write(self, send_room: SendRoom, chunk: Chunk) -> bool:
        """Whether the decode learns of `chunk` from an engine notification rather than CHUNK/DONE.

        Only on a write: a standalone notification (NIXL's `send_notif`) leaves
        only when something progresses the engine again, which for a room with
        nothing more to write is never. The last chunk's write is its aux slot.
        """
        if not self.engine.notifies_receiver:
            return False
        if chunk.last:
            return chunk.aux_src is not None and send_room.aux is not None
        return bool(chunk.src)

    def _start_tail(self, peer: PeerRecord, send_room: SendRoom, chunk: Chunk) -> bool:
        """Issue the commit marker of the last chunk; False if that failed (the room failed)."""
        assert self.pools is not None
        assert peer.pools is not None
        aux_run = [] if chunk.aux_src is None or send_room.aux is None else [(chunk.aux_src, send_room.aux, 1)]
        rides = self._notice_rides_on_write(send_room, chunk)
        note = notification(send_room.token, chunk.nbytes, last=True) if rides else None
        job = self._issue(send_room, peer, page_writes(self.pools.aux, peer.pools.aux, aux_run), note)
        if job is None:
            return False
        chunk.tail = job
        return True

    def _issue(
        self, send_room: SendRoom, peer: PeerRecord, writes: list[Write], note: bytes | None
    ) -> EngineJob | None:
        """Submit `writes` with `note` riding along; None if that failed (the room failed).

        The job returned for no writes is already done: it never enters the
        room's in-flight jobs, so nothing waits for it.
        """
        if writes:
            return self._submit(send_room, peer, writes, note)
        return DoneJob()

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

    def _notice(self, send_room: SendRoom, kind: str, fields: dict[str, Any]) -> None:
        assert send_room.handle is not None
        self.control.send(send_room.peer, kind, {"room": send_room.handle.room, "token": send_room.token, **fields})
