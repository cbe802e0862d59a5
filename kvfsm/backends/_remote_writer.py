"""The prefill's writer: engine writes of each claim's chunks, polled until they end.

`send()` and the stop of a failed claim only queue a command; one thread
per prefill endpoint (`remote.py`) calls `pump()` in a loop, and the
model-based test calls it directly. A pump turn takes up queued commands,
polls each active claim's engine jobs and issues what comes next. The
writer is the only code that touches engine jobs, so whether a claim still
has a write in flight is known in one place, and a claim stays active (and
its record alive) until the engine ended every write it issued, whether or
not the prefill closed the room meanwhile (rule 13).

Back-pressure: every session (one decode peer) has a budget of writes in
flight (`RemoteConfig.max_writes_in_flight`, by default the engine's own
safe figure: half of Mooncake's per-peer TCP queue, which fails the
overflow instead of queueing it). A chunk's writes wait in the claim until
the budget has room. Each turn hands the room round the `_SERVED` oldest
claims of the session that have writes waiting: one slice of at most
`_SLICE` writes each, the claim that went first last turn going last. So
one large room cannot starve the others (it is one of the claims served),
and under a deep queue rooms finish roughly in the order they came instead
of all together at the end (which would make every one of them late).
Claims that only wait for budget sit in their session's queue, not among
the claims polled each turn, so a turn costs the same at 16 or 256 rooms
in flight. An engine that answers "busy" (`EngineBusy`) gets the slice
back and a growing pause; only a real engine error fails the room. A
stopped claim's waiting writes are dropped at once; the ones submitted are
still waited for (the release gate).

When a turn moved nothing, the writer naps from 20 us, doubling up to
`RemoteConfig.poll_interval` (its thread's timer slack is 1 us, so a nap
lasts about what it says). It does not spin: a spinning writer takes a
core from the engine's own threads.

Rule 14, in the order the code keeps it:

* a failed write marks its claim stopped at once, in this thread, before
  anything else of that claim is issued; the room's failure follows;
* before every submit the writer checks the claim is not stopped and the
  room not terminal;
* the last chunk completes only after every KV write landed (and the aux
  slot, when the engine writes it): the writer reads the aux bytes, then
  fires `transfer_done`, and only if that applied, so no failure won the
  race, does the claim step to DONE and send DONE (with the aux bytes).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll
from . import wire
from ._naps import precise_naps
from ._remote_endpoint import RemoteEndpoint, SeenClaims, step
from ._remote_engine import EngineBusy, EngineJob, PartialSubmit, Write, coalesce_runs, page_writes

if TYPE_CHECKING:
    from ._sessions import Session

__all__ = ["Chunk", "Claim", "WriterThread"]

logger = logging.getLogger("kvfsm.backends.remote")

_C = wire.PrefillClaim
#: Most writes one claim submits in one turn (its slice of the session's budget).
_SLICE = 64
#: Claims of one session served at a time, oldest first (the rest wait their turn).
_SERVED = 16
#: When a turn moved nothing the writer naps, from this long and doubling up to
#: `RemoteConfig.poll_interval`. Measured on 2 vCPUs (one-page latency, alternating runs):
#: napping at once 1.14-1.17 ms, spinning 150 us first 1.34-1.55 ms; throughput and CPU
#: per request at 4 and 16 in flight also better without the spin.
_FIRST_NAP = 0.00002
#: An engine that stays busy this long for one claim's writes fails that room.
_BUSY_GIVE_UP = 10.0


_serials = itertools.count()


def _by_serial(claim: Claim) -> int:
    return claim.serial


def _has_waiting(claim: Claim) -> bool:
    return any(chunk.waiting for chunk in claim.chunks)


class Chunk:
    """One `send()` call: its source and destination pages, its writes still to submit, its jobs in flight."""

    __slots__ = ("aux_src", "dst", "jobs", "last", "nbytes", "src", "tail", "todo")

    def __init__(self, src: list[int], dst: list[int], last: bool, aux_src: int | None, nbytes: int) -> None:
        self.src, self.dst, self.last, self.aux_src, self.nbytes = src, dst, last, aux_src, nbytes
        self.jobs: list[Submitted] = []
        # The chunk's engine writes, made at its first turn; those not submitted yet (None: not made yet).
        self.todo: deque[Write] | None = None
        # The last chunk's aux slot, when the engine must write it (device memory), goes after every KV write.
        self.tail: Submitted | None = None

    @property
    def waiting(self) -> bool:
        """Writes of this chunk wait for the session's budget."""
        return self.todo is None or bool(self.todo)


class Submitted:
    """One engine job and the writes it carries (they count against their session's budget)."""

    __slots__ = ("job", "writes")

    def __init__(self, job: EngineJob, writes: int) -> None:
        self.job = job
        self.writes = writes


class Claim:
    """One decode's claim on a prefill room, and what the writer did for it."""

    __slots__ = (
        "aux",
        "busy_since",
        "chunks",
        "cursor",
        "gen",
        "handle",
        "jobs",
        "pages",
        "pgen",
        "queued",
        "retry_at",
        "room",
        "room_closed",
        "serial",
        "session",
        "stopped",
        "timeouts_seen",
        "undrained",
        "wire",
    )

    def __init__(self, session: Session, room: Any, gen: int, pages: list[int], aux: int | None) -> None:
        self.session = session
        self.room = room
        self.gen = gen
        self.pages = pages
        self.aux = aux
        self.handle: TransferHandle | None = None
        self.pgen: int | None = None
        self.wire: wire.PrefillClaim | None = None
        self.cursor = 0
        self.chunks: deque[Chunk] = deque()
        self.jobs: list[Submitted] = []
        # While the engine answers busy: when it started, and when to try again.
        self.busy_since: float | None = None
        self.retry_at = 0.0
        # Claims are served oldest first under back-pressure (see _submit_round);
        # `queued` while the claim is in its session's queue of claims with writes waiting.
        self.serial = next(_serials)
        self.queued = False
        # Set (once) when the claim must issue nothing more; read by the writer before every submit.
        self.stopped = False
        self.room_closed = False
        self.timeouts_seen = 0
        # A failed write that does not prove its bytes stopped: never report this claim drained.
        self.undrained = False

    def fields(self, kind: str, reason: FailureReason | None = None) -> dict[str, Any]:
        base: dict[str, Any] = {"room": self.room, "gen": self.gen, "pgen": self.pgen}
        if kind == "ABORT":
            if reason is None and self.handle is not None:
                reason = self.handle.reason
            return {
                **base,
                "kind": reason.kind.value if reason is not None else FailureKind.ABORTED.value,
                "message": reason.message if reason is not None else "aborted",
            }
        return base

    def notice(self, kind: str, *, nbytes: int, blob: bytes | None = None) -> dict[str, Any]:
        """The fields of a CHUNK or DONE (`_blob` rides along to `_emit`)."""
        return {**self.fields(kind), "nbytes": nbytes, "_blob": blob}

    def __repr__(self) -> str:
        return f"<Claim room={self.room!r} gen={self.gen} {self.wire} jobs={len(self.jobs)}>"


class WriterThread(RemoteEndpoint):
    """The writer of a prefill endpoint and the engine calls it makes."""

    _work: queue.SimpleQueue[tuple[str, Any]]
    _worker: threading.Thread | None
    # Claims polled every turn (writes in flight, stopped, or a chunk to complete), and per
    # session (sid) the claims with writes waiting for budget, oldest first. A claim that
    # only waits for budget is in the second alone, so a turn costs the same at 16 or 256
    # claims in flight.
    _active: dict[int, Claim]
    _queued: dict[str, list[Claim]]
    _seen: dict[str, SeenClaims]
    # Turns of `_submit_round` so far (who goes first), the chunk of the slice being
    # submitted (for writes a busy engine hands back), each session's budget of writes.
    _turn: int
    _slice_chunk: Chunk | None
    _write_budget: int

    def _start_writer(self) -> None:
        self._worker = threading.Thread(target=self._work_loop, name=f"kvfsm-{self.name}-writer", daemon=True)
        self._worker.start()

    def _stop_writer(self) -> None:
        if self._worker is not None:
            self._work.put(("exit", None))
            self._worker.join(5.0)
            self._worker = None

    def _work_loop(self) -> None:
        precise_naps()
        nap = 0.0
        while True:
            try:
                # Nothing to poll: sleep until a command comes (it is taken up first, in order).
                first = None if self._has_work() else self._work.get()
                moved = self.pump(first)
                if moved is None:
                    return
                if moved or not self._has_work():
                    nap = 0.0
                    continue
                # Napping at once, not spinning: a spin here takes a core from the engine's own
                # threads, and on a small machine that made a one-page room slower (see _FIRST_NAP).
                nap = min(self.config.poll_interval, nap * 2 if nap else _FIRST_NAP)
                time.sleep(nap)
            except Exception:
                logger.exception("kvfsm %s writer thread: unexpected error; it goes on", self.name)
                time.sleep(0.01)

    def _has_work(self) -> bool:
        """Whether a claim has writes in flight, waiting or to complete (else the writer waits for a command)."""
        return bool(self._active or self._queued)

    def pump(self, first: tuple[str, Any] | None = None) -> bool | None:
        """One turn: take up queued commands, advance every active claim, submit what the budgets allow.

        Returns whether anything moved, or None once told to exit.
        """
        moved = False
        while True:
            if first is not None:
                command, payload = first
                first = None
            else:
                try:
                    command, payload = self._work.get_nowait()
                except queue.Empty:
                    break
            if command == "exit":
                for claim in self._active.values():
                    for submitted in claim.jobs:
                        submitted.job.cancel()
                return None
            moved = True
            self._command(command, payload)
        for claim in list(self._active.values()):
            moved |= self._advance(claim)
        moved |= self._submit_round()
        for key, claim in list(self._active.items()):
            if not claim.stopped and not claim.jobs and (not claim.chunks or claim.chunks[0].waiting):
                # Nothing to poll (the rest waits in _queued): a submit, a new chunk or a stop
                # brings it back. A stopped claim leaves once drained (_advance), even when its
                # submit failed before anything went out: the decode waits for that ABORT_ACK.
                del self._active[key]
        return moved

    def _command(self, command: str, payload: Any) -> None:
        if command == "chunk":
            claim, chunk = payload
            if not claim.stopped:
                claim.chunks.append(chunk)
                self._active[id(claim)] = claim
                if not claim.queued:
                    claim.queued = True
                    bisect.insort(self._queued.setdefault(claim.session.sid, []), claim, key=_by_serial)
        elif command == "stop":
            claim = payload
            claim.chunks.clear()  # writes not submitted yet are dropped here, never reach the engine
            if claim.queued:
                self._queued[claim.session.sid].remove(claim)
                claim.queued = False
            still = []
            for submitted in claim.jobs:
                if submitted.job.cancel():
                    self._ended(claim, submitted)
                    submitted.job.release()
                else:
                    still.append(submitted)
            claim.jobs = still
            self._active[id(claim)] = claim

    def _ended(self, claim: Claim, submitted: Submitted) -> None:
        claim.session.writes_in_flight -= submitted.writes

    def _poll_jobs(self, claim: Claim) -> str | None:
        """Poll the claim's jobs, keep those still running; the first failure's detail, if any."""
        running: list[Submitted] = []
        failure: str | None = None
        for submitted in claim.jobs:
            job = submitted.job
            status = job.poll()
            if status == "pending":
                running.append(submitted)
                continue
            if status == "timeout":
                # Mooncake's TIMEOUT is derived at read time and not sticky: the write
                # goes on and may still complete. Count it; keep the job in flight so
                # drain stays truthful; the lifecycle's transferring deadline decides.
                claim.timeouts_seen += 1
                self.remote_stats.engine_timeouts += 1
                if self._timeout_fails():
                    failure = failure or f"{self.name} reported TIMEOUT for a write ({job.detail})"
                running.append(submitted)
                continue
            if status == "failed":
                self.remote_stats.engine_failures += 1
                claim.undrained |= job.may_still_land
                failure = failure or f"{self.name} write failed ({job.detail})"
            self._ended(claim, submitted)
            job.release()
        claim.jobs = running
        return failure

    def _advance(self, claim: Claim) -> bool:
        """Poll the claim's writes, stop or drain it, and complete its chunks in order (no submits here)."""
        before = len(claim.jobs)
        failure = self._poll_jobs(claim)
        moved = len(claim.jobs) != before
        if failure is not None and not claim.stopped:
            self._write_failed(claim, failure)
            moved = True
        if claim.stopped:
            if not claim.jobs:
                self._drained(claim)
                self._active.pop(id(claim), None)
                return True
            return moved
        handle = claim.handle
        if handle is None:
            return moved
        while claim.chunks:
            chunk = claim.chunks[0]
            chunk.jobs = [submitted for submitted in chunk.jobs if submitted in claim.jobs]
            if chunk.waiting or chunk.jobs:
                break
            if not chunk.last:
                claim.chunks.popleft()
                handle.chunk_done(chunk.nbytes)
                with self._lock:
                    row = step(wire.CLAIM_TABLE, claim, "progress")
                    if row is not None:
                        self._emit(claim.session, row, functools.partial(claim.notice, nbytes=chunk.nbytes))
                moved = True
                continue
            if not self._finish(claim, chunk):
                return moved
            claim.chunks.popleft()
            moved = True
        return moved

    def _submit_round(self) -> bool:
        """Hand each session's free budget round its claims, one slice each, fairly (see the module docstring)."""
        if not self._queued:
            return False
        self._turn += 1
        now = time.monotonic()
        moved = False
        for sid, queued in list(self._queued.items()):
            served = self._oldest_waiting(queued)
            if not queued:
                del self._queued[sid]
            if not served:
                continue
            budget = self._write_budget - served[0].session.writes_in_flight
            start = self._turn % len(served)
            for claim in served[start:] + served[:start]:
                if budget <= 0:
                    break
                if claim.retry_at > now:
                    continue
                sent = self._submit_slice(claim, min(budget, _SLICE))
                budget -= sent
                moved |= sent > 0
                self._active[id(claim)] = claim  # it has writes to poll, or a chunk to complete
                if not _has_waiting(claim):
                    queued.remove(claim)
                    claim.queued = False
            if not queued:
                self._queued.pop(sid, None)
        return moved

    @staticmethod
    def _oldest_waiting(queued: list[Claim]) -> list[Claim]:
        """The `_SERVED` oldest claims of a session's queue that still wait; the others that stopped leave it."""
        served: list[Claim] = []
        index = 0
        while index < len(queued) and len(served) < _SERVED:
            claim = queued[index]
            if claim.stopped or not _has_waiting(claim):
                del queued[index]
                claim.queued = False
                continue
            served.append(claim)
            index += 1
        return served

    def _submit_slice(self, claim: Claim, most: int) -> int:
        """Submit up to `most` waiting writes of the claim's first chunks; how many went out."""
        handle = claim.handle
        assert handle is not None and self.pools is not None
        peer = claim.session
        assert peer.pools is not None
        for chunk in claim.chunks:
            if not chunk.waiting:
                continue
            if claim.stopped or handle.is_terminal:
                return 0  # rule 14: nothing more for a room that ended, whatever the notices say
            if chunk.todo is None:
                chunk.todo = deque(page_writes(self.pools.kv, peer.pools.kv, coalesce_runs(chunk.src, chunk.dst)))
                if not chunk.todo:
                    continue
            writes = [chunk.todo.popleft() for _ in range(min(most, len(chunk.todo)))]
            self._slice_chunk = chunk
            submitted = self._submit(claim, writes)
            if submitted is None:
                if claim.busy_since is not None and not claim.stopped:
                    chunk.todo.extendleft(reversed(writes))  # the engine was busy: these go again
                return 0
            chunk.jobs.append(submitted)
            return submitted.writes
        return 0

    def _requeue(self, claim: Claim, writes: list[Write]) -> None:
        """Put writes a busy engine did not take back in front of the chunk they came from."""
        chunk = self._slice_chunk
        if chunk is not None and chunk.todo is not None and not claim.stopped:
            chunk.todo.extendleft(reversed(writes))

    def _finish(self, claim: Claim, chunk: Chunk) -> bool:
        """Complete the last chunk once every write landed; False while its aux write is still out."""
        handle = claim.handle
        assert handle is not None and self.pools is not None
        blob: bytes | None = None
        if chunk.aux_src is not None and claim.aux is not None:
            if self._aux_in_done(claim):
                blob = b"".join(
                    ctypes.string_at(r.ptr + chunk.aux_src * r.page_nbytes, r.page_nbytes) for r in self.pools.aux
                )
            else:
                if chunk.tail is None:
                    peer = claim.session
                    assert peer.pools is not None
                    if claim.stopped or handle.is_terminal:
                        return True
                    if peer.writes_in_flight >= self._write_budget or claim.retry_at > time.monotonic():
                        return False
                    writes = page_writes(self.pools.aux, peer.pools.aux, [(chunk.aux_src, claim.aux, 1)])
                    tail = self._submit(claim, writes)
                    if tail is None:
                        return False
                    chunk.tail = tail
                if chunk.tail in claim.jobs:
                    return False
        self._complete(claim, chunk, blob)
        return True

    def _complete(self, claim: Claim, chunk: Chunk, blob: bytes | None) -> None:
        """The commit point: nothing of the claim is in flight; check the room, complete it, then tell the decode."""
        handle = claim.handle
        assert handle is not None
        if claim.stopped or handle.state is not KVPoll.Transferring:
            return
        handle.chunk_done(chunk.nbytes, last=True)
        if handle.transfer_done():
            with self._lock:
                row = step(wire.CLAIM_TABLE, claim, "landed")
                if row is not None:
                    self._emit(claim.session, row, functools.partial(claim.notice, nbytes=chunk.nbytes, blob=blob))
                self._drop_if_done(claim)

    def _aux_in_done(self, claim: Claim) -> bool:
        """Whether the aux bytes travel inside DONE: both aux pools are host memory and a slot fits a frame."""
        assert self.pools is not None and claim.session.pools is not None
        if sum(r.page_nbytes for r in self.pools.aux) > wire.MAX_BLOB_BYTES:
            return False
        return all(r.device == "cpu" for r in (*self.pools.aux, *claim.session.pools.aux))

    def _submit(self, claim: Claim, writes: list[Write]) -> Submitted | None:
        """Submit `writes` as one job, counted against the session's budget; None if it did not go out.

        A busy engine (`EngineBusy`) leaves the claim to try again after a
        growing pause, and fails it only after `_BUSY_GIVE_UP` seconds; any
        other error fails the room at once (rule 14: nothing more of it goes out).
        """
        peer = claim.session
        try:
            job = self.engine.submit(peer.target, writes)
        except EngineBusy as exc:
            now = time.monotonic()
            self.remote_stats.engine_busy += 1
            if exc.job is not None:
                # Part went out before the engine said busy: wait for it; the rest goes again.
                partial = Submitted(exc.job, exc.submitted)
                peer.writes_in_flight += partial.writes
                claim.jobs.append(partial)
                self._requeue(claim, writes[exc.submitted :])
                claim.retry_at = now + 0.001
                return partial
            if claim.busy_since is None:
                claim.busy_since = now
            waited = now - claim.busy_since
            if waited <= _BUSY_GIVE_UP:
                claim.retry_at = now + min(0.1, 0.001 * 2 ** min(10, int(waited * 20)))
                return None
            claim.busy_since = None
            self._write_failed(claim, f"{self.name} stayed busy for {waited:.1f}s: {exc}")
            return None
        except Exception as exc:
            if isinstance(exc, PartialSubmit):
                partial = Submitted(exc.job, exc.submitted)
                peer.writes_in_flight += partial.writes
                claim.jobs.append(partial)
            logger.warning("kvfsm %s: submitting %d writes failed: %s", self.name, len(writes), exc)
            self.remote_stats.engine_failures += 1
            self._write_failed(claim, f"{self.name} submit failed: {exc}")
            return None
        claim.busy_since = None
        self.remote_stats.jobs_submitted += 1
        self.remote_stats.writes_submitted += len(writes)
        submitted = Submitted(job, len(writes))
        peer.writes_in_flight += submitted.writes
        claim.jobs.append(submitted)
        return submitted

    def _write_failed(self, claim: Claim, message: str) -> None:
        """A write of `claim` failed: stop it here and now, tell the decode, then fail its room (rule 14)."""
        reason = FailureReason(FailureKind.TRANSFER_ERROR, message)
        claim.stopped = True
        claim.chunks.clear()
        with self._lock:
            self._fail_claim(claim, "fail", reason)
        if claim.handle is not None:
            claim.handle.fail(reason)

    def _drained(self, claim: Claim) -> None:
        """Every write of a stopped claim ended: ACK (unless one may still land), report, forget."""
        claim.chunks.clear()
        if claim.undrained:
            logger.warning(
                "kvfsm %s room %r: a failed write may still land; no ABORT_ACK, the drain deadline decides",
                self.name,
                claim.room,
            )
            return
        with self._lock:
            row = step(wire.CLAIM_TABLE, claim, "drained")
            if row is not None:
                self._emit(claim.session, row, claim.fields)
            self._drop_if_done(claim)
        handle = claim.handle
        if handle is not None:
            handle.writes_drained()

    def _drop_if_done(self, claim: Claim) -> None:  # the sender half's
        raise NotImplementedError

    def _fail_claim(self, claim: Claim, input: str, reason: FailureReason | None) -> bool:  # the sender half's
        raise NotImplementedError
