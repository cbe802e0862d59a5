"""The prefill's writer lanes: one per decode session, every engine call about that decode in it.

A lane owns one decode session's engine work: it opens the decode's engine
peer (`add_peer`), submits and polls the writes of that session's claims,
and removes the peer once the session is gone and nothing of it is in
flight. `send()` and the stop of a failed claim only queue a command on the
claim's lane; each lane has a thread of its own (`remote.py` says when to
start it), and the model-based test calls `pump()` itself. So a call that
blocks, such as Mooncake's first write to a new peer, which opens the
peer's segment with a synchronous handshake, holds up that decode's rooms
and no one else's: a room's writes never queue behind another peer's. The
call is also bounded: the lane notes when each engine call began
(`call_since`), and the prefill's housekeeping loses a session whose lane
has been inside one call for longer than `RemoteConfig.engine_call_timeout`
(its rooms fail; the writes of the stuck call stay accounted until it
returns, so nothing is reported drained early). A lane is the only code
that touches its jobs, so whether a claim still has a write in flight is
known in one place, and a claim stays active (its record alive) until the
engine ended every write it issued, whether or not the prefill closed the
room meanwhile (rule 13).

An engine that raises where it should report a status (NIXL's
`check_xfer_state` raises `nixlRemoteDisconnectError` when the decode went
away) fails the claim of that job and nothing else: the job is cancelled if
the engine can prove it, else its room is never reported drained (the drain
deadline decides), and the lane goes on with its other claims.

Back-pressure: every session has a budget of writes in flight
(`RemoteConfig.max_writes_in_flight`, by default the engine's own safe
figure: half of Mooncake's per-peer TCP queue, which fails the overflow
instead of queueing it). A chunk's writes wait in the claim until the
budget has room. Each turn hands the room round the `_SERVED` oldest claims
of the session that have writes waiting: one slice of at most `_SLICE`
writes each, the claim that went first last turn going last. So one large
room cannot starve the others, and under a deep queue rooms finish roughly
in the order they came. Claims that only wait for budget sit in the lane's
queue, not among the claims polled each turn, so a turn costs the same at
16 or 256 rooms in flight. An engine that answers "busy" (`EngineBusy`)
gets the slice back and a growing pause; only a real engine error fails the
room. A stopped claim's waiting writes are dropped at once; the ones
submitted are still waited for (the release gate).

When a turn moved nothing, the lane naps from 20 us, doubling up to
`RemoteConfig.poll_interval` (its thread's timer slack is 1 us, so a nap
lasts about what it says). It does not spin: a spinning writer takes a core
from the engine's own threads. A lane with nothing in flight sleeps until a
command comes.

Rule 14, in the order the code keeps it:

* a failed write marks its claim stopped at once, in this thread, before
  anything else of that claim is issued; the room's failure follows;
* before every submit the lane checks the claim is not stopped and the
  room not terminal;
* the last chunk completes only after every KV write landed (and the aux
  slot, when the engine writes it): the lane reads the aux bytes, then
  fires `transfer_done`, and only if that applied, so no failure won the
  race, does the claim step to DONE and send DONE (with the aux bytes);
* with completion on the data plane (`_markers`) the commit marker is
  written at that same point, just before DONE, and nowhere else; the aux
  slot then goes by the engine beside the last chunk's writes, and the
  marker's write counts against the budget and keeps the claim polled
  until it ends (a marker that cannot go out leaves the room to DONE). A
  decode that asked for its markers as engine notifications gets one sent
  at that same point instead: nothing of it is polled or budgeted.
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll
from . import wire
from ._markers import MARKER_BYTES, MarkerSlots, notification
from ._naps import precise_naps
from ._remote_endpoint import RemoteConfig, RemoteStats, step
from ._remote_engine import EngineAdapter, EngineBusy, EngineJob, PartialSubmit, Write, page_writes

if TYPE_CHECKING:
    from ._sessions import Session
    from .memory import KVPools

__all__ = ["Chunk", "Claim", "Lane", "LaneOwner"]

logger = logging.getLogger("kvfsm.backends.remote")

_C = wire.PrefillClaim
#: Most writes one claim submits in one turn (its slice of the session's budget).
_SLICE = 64
#: Claims of one session served at a time, oldest first (the rest wait their turn).
_SERVED = 16
#: When a turn moved nothing the lane naps, from this long and doubling up to
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


class LaneOwner(Protocol):
    """What a lane needs of the prefill endpoint that owns it (`_remote_sender.PrefillEndpoint`)."""

    name: str
    config: RemoteConfig
    engine: EngineAdapter
    remote_stats: RemoteStats
    markers: MarkerSlots | None
    _lock: threading.Lock

    @property
    def pools(self) -> KVPools | None: ...

    def _clock_now(self) -> float: ...

    def _timeout_fails(self) -> bool: ...

    def _emit(self, session: Session | None, row: wire.WireRow, build: Callable[[str], dict[str, Any]]) -> None: ...

    def _fail_claim(self, claim: Claim, input: str, reason: FailureReason | None) -> bool: ...

    def _drop_if_done(self, claim: Claim) -> None: ...

    def _lane_broken(self, lane: Lane, why: str) -> None: ...

    def _lane_ended(self, lane: Lane) -> None: ...

    def _kv_writes(self, lane: Lane, src: list[int], dst: list[int]) -> list[Write]: ...


class Chunk:
    """One `send()` call: its source and destination pages, its writes still to submit, its jobs in flight."""

    __slots__ = ("aux_inline", "aux_src", "dst", "jobs", "last", "nbytes", "src", "tail", "todo")

    def __init__(self, src: list[int], dst: list[int], last: bool, aux_src: int | None, nbytes: int) -> None:
        self.src, self.dst, self.last, self.aux_src, self.nbytes = src, dst, last, aux_src, nbytes
        self.jobs: list[Submitted] = []
        # The chunk's engine writes, made at its first turn; those not submitted yet (None: not made yet).
        self.todo: deque[Write] | None = None
        # The last chunk's aux slot, when the engine must write it (device memory), goes after every KV write.
        self.tail: Submitted | None = None
        # ... or among the chunk's own writes, when a commit marker completes the room (`_aux_rides_along`).
        self.aux_inline = False

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
    """One decode's claim on a prefill room, and what its lane did for it."""

    __slots__ = (
        "aux",
        "aux_src",
        "busy_since",
        "chunks",
        "chunks_done",
        "cursor",
        "gen",
        "handle",
        "jobs",
        "marker",
        "marker_job",
        "marker_src",
        "nbytes_done",
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
        # The source aux slot the prefill named, with whichever chunk it named it (the last one named wins).
        self.aux_src: int | None = None
        self.handle: TransferHandle | None = None
        self.pgen: int | None = None
        self.wire: wire.PrefillClaim | None = None
        self.cursor = 0
        self.chunks: deque[Chunk] = deque()
        self.jobs: list[Submitted] = []
        # While the engine answers busy: when it started, and when to try again.
        self.busy_since: float | None = None
        self.retry_at = 0.0
        # Claims are served oldest first under back-pressure (see Lane._submit_round);
        # `queued` while the claim is in its lane's queue of claims with writes waiting.
        self.serial = next(_serials)
        self.queued = False
        # Set (once) when the claim must issue nothing more; read by the lane before every submit.
        self.stopped = False
        self.room_closed = False
        self.timeouts_seen = 0
        # A failed write that does not prove its bytes stopped: never report this claim drained.
        self.undrained = False
        # The decode's commit-marker address and token (`_markers`), if its claim named a slot; the
        # marker's write once submitted, and the slot of ours it is written from.
        self.marker: tuple[int, int] | None = None
        self.marker_job: Submitted | None = None
        self.marker_src: int | None = None
        # Bytes and chunks completed so far (the marker carries the room's totals).
        self.nbytes_done = 0
        self.chunks_done = 0

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


class _EngineCall:
    """What `Lane._calling` returns: leaving it ends the noted engine call (one per lane, reused).

    A class, not a generator context manager: a turn makes an engine call per
    job it polls, and this costs a fraction of what `contextlib` does.
    """

    __slots__ = ("lane",)

    def __init__(self, lane: Lane) -> None:
        self.lane = lane

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self.lane.call_since = None


class Lane:
    """The writer of one decode session on a prefill, and every engine call about that decode."""

    def __init__(self, owner: LaneOwner, session: Session, budget: int, hello: tuple[dict[str, Any], bytes | None]):
        self.owner = owner
        self.session = session
        self.budget = budget
        self.commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Claims polled every turn (writes in flight, stopped, or a chunk to complete), and the
        # claims with writes waiting for budget, oldest first.
        self.active: dict[int, Claim] = {}
        self.queued: list[Claim] = []
        # Turns of `_submit_round` so far (who goes first), the chunk of the slice being
        # submitted (for writes a busy engine hands back).
        self.turn = 0
        self.slice_chunk: Chunk | None = None
        # What the decode said of its engine in its HELLO (`PrefillEndpoint.claim_peer` reads it).
        self.peer_session: dict[str, Any] = hello[0]
        # The decode's engine peer (`add_peer`), once opened; why it could not be, if it could not.
        self.target: Any = None
        self.broken: str | None = None
        self.closing = False
        self.ended = False
        # The engine call under way: since when (the owner's clock) and what, for the watchdog.
        self.call_since: float | None = None
        self.call_what = ""
        self.thread: threading.Thread | None = None
        self._engine_call = _EngineCall(self)
        self.commands.put(("open", hello))

    def __repr__(self) -> str:
        return f"<Lane {self.session.addr} active={len(self.active)} queued={len(self.queued)}>"

    # -- the thread -------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"kvfsm-{self.owner.name}-lane", daemon=True)
        self.thread.start()

    def put(self, command: str, payload: Any = None) -> None:
        self.commands.put((command, payload))

    def stuck_for(self, now: float) -> float:
        """Seconds the lane has been inside one engine call (0 when it is not in one)."""
        since = self.call_since
        return 0.0 if since is None else max(0.0, now - since)

    def _run(self) -> None:
        precise_naps()
        nap = 0.0
        while True:
            try:
                # Nothing to poll: sleep until a command comes (it is taken up first, in order).
                first = None if self.has_work() else self.commands.get()
                moved = self.pump(first)
                if moved is None:
                    return
                if moved or not self.has_work():
                    nap = 0.0
                    continue
                # Napping at once, not spinning: a spin here takes a core from the engine's own
                # threads, and on a small machine that made a one-page room slower (see _FIRST_NAP).
                nap = min(self.owner.config.poll_interval, nap * 2 if nap else _FIRST_NAP)
                time.sleep(nap)
            except Exception:
                logger.exception(
                    "kvfsm %s lane of %s: unexpected error; it goes on", self.owner.name, self.session.addr
                )
                time.sleep(0.01)

    def has_work(self) -> bool:
        """Whether a claim has writes in flight, waiting or to complete (else the lane waits for a command)."""
        return bool(self.active or self.queued)

    def _calling(self, what: str) -> _EngineCall:
        """Note an engine call for the watchdog (`stuck_for`) while it runs: `with self._calling(what):`."""
        self.call_what = what
        self.call_since = self.owner._clock_now()
        return self._engine_call

    # -- one turn ---------------------------------------------------------------------------------

    def pump(self, first: tuple[str, Any] | None = None) -> bool | None:
        """One turn: take up queued commands, advance every active claim, submit what the budget allows.

        Returns whether anything moved, or None once the lane ended.
        """
        if self.ended:
            return None
        moved = False
        while True:
            if first is not None:
                command, payload = first
                first = None
            else:
                try:
                    command, payload = self.commands.get_nowait()
                except queue.Empty:
                    break
            if command == "exit":
                for claim in self.active.values():
                    for submitted in claim.jobs:
                        self._cancel(submitted.job)
                    if claim.marker_job is not None:
                        self._cancel(claim.marker_job.job)
                self.ended = True
                return None
            moved = True
            self._command(command, payload)
        for claim in list(self.active.values()):
            moved |= self._guarded(claim, self._advance)
        moved |= self._submit_round()
        for key, claim in list(self.active.items()):
            if (
                not claim.stopped
                and not claim.jobs
                and claim.marker_job is None
                and (not claim.chunks or claim.chunks[0].waiting)
            ):
                # Nothing to poll (the rest waits in `queued`): a submit, a new chunk or a stop
                # brings it back. A stopped claim leaves once drained (_advance), even when its
                # submit failed before anything went out: the decode waits for that ABORT_ACK.
                del self.active[key]
        if self.closing and not self.has_work():
            self._end()
            return None
        return moved

    def _end(self) -> None:
        """The session is gone and nothing of it is in flight: remove the engine peer, stop."""
        self.ended = True
        if self.target is not None:
            target, self.target = self.target, None
            try:
                with self._calling("remove_peer"):
                    self.owner.engine.remove_peer(target)
            except Exception as exc:
                logger.debug(
                    "kvfsm %s: removing the engine peer of %s failed: %s", self.owner.name, self.session.addr, exc
                )
        self.owner._lane_ended(self)

    def _guarded(self, claim: Claim, work: Callable[[Claim], bool]) -> bool:
        """Run one claim's work; an unexpected error fails that claim alone, never the lane."""
        try:
            return work(claim)
        except Exception as exc:
            self._crashed(claim, exc)
            return True

    def _crashed(self, claim: Claim, exc: Exception) -> None:
        logger.exception("kvfsm %s: the writer failed on room %r; that room fails", self.owner.name, claim.room)
        self.owner.remote_stats.engine_errors += 1
        claim.undrained = True  # what it had out is not known any more: the drain deadline decides
        if not claim.stopped:
            self._write_failed(claim, f"{self.owner.name} writer error: {exc!r:.200}")
        for submitted in claim.jobs:
            self._ended(claim, submitted)
        claim.jobs = []

    def _command(self, command: str, payload: Any) -> None:
        if command == "chunk":
            claim, chunk = payload
            if not claim.stopped:
                claim.chunks.append(chunk)
                self.active[id(claim)] = claim
                if not claim.queued:
                    claim.queued = True
                    bisect.insort(self.queued, claim, key=_by_serial)
        elif command == "stop":
            claim = payload
            claim.chunks.clear()  # writes not submitted yet are dropped here, never reach the engine
            if claim.queued:
                self.queued.remove(claim)
                claim.queued = False
            still = []
            for submitted in claim.jobs:
                if self._cancel(submitted.job):
                    self._ended(claim, submitted)
                    self._release(submitted.job)
                else:
                    still.append(submitted)
            claim.jobs = still
            self.active[id(claim)] = claim
        elif command == "open":
            fields, blob = payload
            try:
                with self._calling("add_peer"):
                    self.target = self.owner.engine.add_peer(fields, blob)
            except Exception as exc:
                self.broken = f"{self.owner.name} could not open the decode's engine session: {exc}"
                logger.warning("kvfsm %s: %s (%s)", self.owner.name, self.broken, self.session.addr)
                self.owner._lane_broken(self, self.broken)
        elif command == "close":
            self.closing = True
        elif command == "sync" and not self.has_work():
            # Commands run in order: everything queued before this one has been taken up.
            payload.set()

    def _ended(self, claim: Claim, submitted: Submitted) -> None:
        claim.session.writes_in_flight -= submitted.writes

    def _cancel(self, job: EngineJob) -> bool:
        try:
            with self._calling("cancel"):
                return job.cancel()
        except Exception as exc:
            self.owner.remote_stats.engine_errors += 1
            logger.debug("kvfsm %s: cancelling a job raised: %s", self.owner.name, exc)
            return False

    def _release(self, job: EngineJob) -> None:
        try:
            with self._calling("release"):
                job.release()
        except Exception as exc:
            self.owner.remote_stats.engine_errors += 1
            logger.debug("kvfsm %s: releasing a job raised: %s", self.owner.name, exc)

    def _poll_jobs(self, claim: Claim) -> str | None:
        """Poll the claim's jobs, keep those still running; the first failure's detail, if any."""
        running: list[Submitted] = []
        failure: str | None = None
        stats = self.owner.remote_stats
        for submitted in claim.jobs:
            job = submitted.job
            try:
                with self._calling("poll"):
                    status = job.poll()
            except Exception as exc:
                # The engine raised instead of reporting: this job failed, and unless the engine
                # proves it stopped (a cancel that took), its bytes may still land.
                stats.engine_errors += 1
                stats.engine_failures += 1
                claim.undrained |= not self._cancel(job)
                failure = failure or f"{self.owner.name} write failed: polling it raised {exc!r:.200} ({job.detail})"
                self._ended(claim, submitted)
                self._release(job)
                continue
            if status == "pending":
                running.append(submitted)
                continue
            if status == "timeout":
                # Mooncake's TIMEOUT is derived at read time and not sticky: the write
                # goes on and may still complete. Count it; keep the job in flight so
                # drain stays truthful; the lifecycle's transferring deadline decides.
                claim.timeouts_seen += 1
                stats.engine_timeouts += 1
                if self.owner._timeout_fails():
                    failure = failure or f"{self.owner.name} reported TIMEOUT for a write ({job.detail})"
                running.append(submitted)
                continue
            if status == "failed":
                stats.engine_failures += 1
                claim.undrained |= job.may_still_land
                failure = failure or f"{self.owner.name} write failed ({job.detail})"
            self._ended(claim, submitted)
            self._release(job)
        claim.jobs = running
        return failure

    def _advance(self, claim: Claim) -> bool:
        """Poll the claim's writes, stop or drain it, and complete its chunks in order (no submits here)."""
        if claim.marker_job is not None:
            self._poll_marker(claim)
        before = len(claim.jobs)
        failure = self._poll_jobs(claim)
        moved = len(claim.jobs) != before
        if failure is not None and not claim.stopped:
            self._write_failed(claim, failure)
            moved = True
        if claim.stopped:
            if not claim.jobs:
                self._drained(claim)
                self.active.pop(id(claim), None)
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
                claim.nbytes_done += chunk.nbytes
                claim.chunks_done += 1
                handle.chunk_done(chunk.nbytes)
                with self.owner._lock:
                    row = step(wire.CLAIM_TABLE, claim, "progress")
                    if row is not None:
                        self.owner._emit(claim.session, row, functools.partial(claim.notice, nbytes=chunk.nbytes))
                moved = True
                continue
            if not self._finish(claim, chunk):
                return moved
            claim.chunks.popleft()
            moved = True
        return moved

    def _submit_round(self) -> bool:
        """Hand the session's free budget round its claims, one slice each, fairly (see the module docstring)."""
        if not self.queued:
            return False
        self.turn += 1
        now = time.monotonic()
        moved = False
        served = self._oldest_waiting()
        if not served:
            return False
        budget = self.budget - self.session.writes_in_flight
        start = self.turn % len(served)
        for claim in served[start:] + served[:start]:
            if budget <= 0:
                break
            if claim.retry_at > now:
                continue
            try:
                sent = self._submit_slice(claim, min(budget, _SLICE))
            except Exception as exc:
                self._crashed(claim, exc)
                sent = 0
            moved |= sent > 0
            budget -= sent
            self.active[id(claim)] = claim  # it has writes to poll, or a chunk to complete
            if claim.queued and not _has_waiting(claim):
                self.queued.remove(claim)
                claim.queued = False
        return moved

    def _oldest_waiting(self) -> list[Claim]:
        """The `_SERVED` oldest claims of the queue that still wait; the others that stopped leave it."""
        queued = self.queued
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
        pools = self.owner.pools
        assert handle is not None and pools is not None
        peer = claim.session
        assert peer.pools is not None
        for chunk in claim.chunks:
            if not chunk.waiting:
                continue
            if claim.stopped or handle.is_terminal:
                return 0  # rule 14: nothing more for a room that ended, whatever the notices say
            if chunk.todo is None:
                writes = self.owner._kv_writes(self, chunk.src, chunk.dst)
                if chunk.last and self._aux_rides_along(claim):
                    assert claim.aux_src is not None and claim.aux is not None
                    writes += page_writes(pools.aux, peer.pools.aux, [(claim.aux_src, claim.aux, 1)])
                    chunk.aux_inline = True
                chunk.todo = deque(writes)
                if not chunk.todo:
                    continue
            todo = chunk.todo
            if len(todo) <= most:
                writes = list(todo)
                todo.clear()
            else:
                take = todo.popleft
                writes = [take() for _ in range(most)]
            self.slice_chunk = chunk
            submitted = self._submit(claim, writes)
            if submitted is None:
                if claim.busy_since is not None and not claim.stopped:
                    chunk.todo.extendleft(reversed(writes))  # the engine was busy: these go again
                return 0
            chunk.jobs.append(submitted)
            if (
                chunk.last
                and not chunk.todo
                and chunk.tail is None
                and not chunk.aux_inline
                and self._marks(claim)
                and claim.aux is not None
            ):
                # The marker, not the order of writes, commits the room: the aux slot need not wait.
                self._submit_tail(claim, chunk)
            return submitted.writes
        return 0

    def _requeue(self, claim: Claim, writes: list[Write]) -> None:
        """Put writes a busy engine did not take back in front of the chunk they came from."""
        chunk = self.slice_chunk
        if chunk is not None and chunk.todo is not None and not claim.stopped:
            chunk.todo.extendleft(reversed(writes))

    def _finish(self, claim: Claim, chunk: Chunk) -> bool:
        """Complete the last chunk once every write landed; False while its aux write is still out."""
        handle = claim.handle
        pools = self.owner.pools
        assert handle is not None and pools is not None
        blob: bytes | None = None
        aux_src = claim.aux_src
        if aux_src is not None and claim.aux is not None:
            if self._aux_in_done(claim):
                blob = b"".join(ctypes.string_at(r.ptr + aux_src * r.page_nbytes, r.page_nbytes) for r in pools.aux)
            elif not chunk.aux_inline:
                if chunk.tail is None:
                    if claim.stopped or handle.is_terminal:
                        return True
                    if not self._submit_tail(claim, chunk):
                        return False
                if chunk.tail in claim.jobs:
                    return False
        self._complete(claim, chunk, blob)
        return True

    def _submit_tail(self, claim: Claim, chunk: Chunk) -> bool:
        """Submit the last chunk's aux slot write (engine-written aux); False if it must wait."""
        pools = self.owner.pools
        peer = claim.session
        assert pools is not None and peer.pools is not None and claim.aux_src is not None and claim.aux is not None
        if peer.writes_in_flight >= self.budget or claim.retry_at > time.monotonic():
            return False
        writes = page_writes(pools.aux, peer.pools.aux, [(claim.aux_src, claim.aux, 1)])
        host = all(r.device == "cpu" for r in (*pools.aux, *peer.pools.aux))
        tail = self._submit(claim, writes, host=host)
        if tail is None:
            return False
        chunk.tail = tail
        return True

    def _aux_rides_along(self, claim: Claim) -> bool:
        """Whether the last chunk's aux slot goes in that chunk's own writes, not as a job after them.

        Only when a commit marker completes the room (the order of the writes
        then proves nothing; the marker after all of them does), and the aux
        slots are in the same kind of memory as the pages on both sides, so
        that one engine job can carry them (one NIXL transfer, not two).
        """
        pools, theirs = self.owner.pools, claim.session.pools
        if not self._marks(claim) or claim.aux is None or claim.aux_src is None or pools is None or theirs is None:
            return False
        return all(len({r.device for r in (*side.kv, *side.aux)}) == 1 for side in (pools, theirs))

    def _marks(self, claim: Claim) -> bool:
        """Whether this claim's room completes on a commit marker we write (its aux then goes by the engine)."""
        return claim.marker is not None and self.owner.markers is not None

    def _write_marker(self, claim: Claim, nbytes: int, chunks: int) -> None:
        """Every write of the room landed and it succeeded here: write its commit marker into the decode.

        Rule 14 holds by where this is called: only from `_complete`, after
        every job of the claim ended without failure and `transfer_done`
        applied. A marker that cannot be written costs only time: DONE
        follows and completes the room.
        """
        markers = self.owner.markers
        stats = self.owner.remote_stats
        if claim.marker is None or markers is None:
            return
        address, token = claim.marker
        if claim.session.notify:
            self._notify_marker(claim, token, nbytes, chunks)
            return
        if claim.session.writes_in_flight >= self.budget:
            stats.markers_missed += 1  # the budget holds for markers too; DONE is on its way
            return
        source = markers.take()
        if source is None:
            stats.markers_missed += 1
            return
        markers.write(source, token, nbytes, chunks)
        try:
            with self._calling("submit of the commit marker"):
                job = self.owner.engine.submit_host(self.target, [(markers.address(source), address, MARKER_BYTES)])
        except Exception as exc:
            stats.markers_missed += 1
            markers.give(source)
            logger.debug("kvfsm %s room %r: the commit marker was not submitted: %s", self.owner.name, claim.room, exc)
            return
        claim.marker_src = source
        claim.marker_job = Submitted(job, 1)
        claim.session.writes_in_flight += 1

    def _notify_marker(self, claim: Claim, token: int, nbytes: int, chunks: int) -> None:
        """The marker as the engine's notification (`_markers`): nothing to poll, nothing in flight after."""
        stats = self.owner.remote_stats
        try:
            with self._calling("notification of the commit marker"):
                self.owner.engine.notify(self.target, notification(token, nbytes, chunks))
        except Exception as exc:
            stats.markers_missed += 1
            logger.debug("kvfsm %s room %r: the commit marker was not sent: %s", self.owner.name, claim.room, exc)
            return
        stats.markers_written += 1

    def _poll_marker(self, claim: Claim) -> None:
        """Poll the commit marker's write; once it ended, free its source slot (unless it may still be read)."""
        submitted = claim.marker_job
        assert submitted is not None
        stats = self.owner.remote_stats
        job = submitted.job
        try:
            with self._calling("poll of the commit marker"):
                status = job.poll()
        except Exception as exc:
            stats.engine_errors += 1
            logger.debug("kvfsm %s: polling a commit marker raised: %s", self.owner.name, exc)
            status = "failed"
            job.may_still_land |= not self._cancel(job)
        if status in ("pending", "timeout"):
            return
        if status == "done":
            stats.markers_written += 1
        else:
            stats.markers_missed += 1
        claim.marker_job = None
        self._ended(claim, submitted)
        self._release(job)
        markers = self.owner.markers
        if claim.marker_src is not None and markers is not None and not job.may_still_land:
            markers.give(claim.marker_src)
        claim.marker_src = None

    def _complete(self, claim: Claim, chunk: Chunk, blob: bytes | None) -> None:
        """The commit point: nothing of the claim is in flight; check the room, complete it, then tell the decode."""
        handle = claim.handle
        assert handle is not None
        if claim.stopped or handle.state is not KVPoll.Transferring:
            return
        handle.chunk_done(chunk.nbytes, last=True)
        if handle.transfer_done():
            self._write_marker(claim, claim.nbytes_done + chunk.nbytes, claim.chunks_done + 1)
            with self.owner._lock:
                row = step(wire.CLAIM_TABLE, claim, "landed")
                if row is not None:
                    self.owner._emit(
                        claim.session, row, functools.partial(claim.notice, nbytes=chunk.nbytes, blob=blob)
                    )
                self.owner._drop_if_done(claim)

    def _aux_in_done(self, claim: Claim) -> bool:
        """Whether the aux bytes travel inside DONE: both aux pools are host memory and a slot fits a frame."""
        pools = self.owner.pools
        assert pools is not None and claim.session.pools is not None
        if self._marks(claim) or sum(r.page_nbytes for r in pools.aux) > wire.MAX_BLOB_BYTES:
            return False
        return all(r.device == "cpu" for r in (*pools.aux, *claim.session.pools.aux))

    def _submit(self, claim: Claim, writes: list[Write], *, host: bool = False) -> Submitted | None:
        """Submit `writes` as one job, counted against the session's budget; None if it did not go out.

        A busy engine (`EngineBusy`) leaves the claim to try again after a
        growing pause, and fails it only after `_BUSY_GIVE_UP` seconds; any
        other error fails the room at once (rule 14: nothing more of it goes out).
        """
        peer = claim.session
        stats = self.owner.remote_stats
        name = self.owner.name
        if self.broken is not None:
            self._write_failed(claim, self.broken)
            return None
        try:
            with self._calling(f"submit of {len(writes)} writes"):
                engine = self.owner.engine
                job = (engine.submit_host if host else engine.submit)(self.target, writes)
        except EngineBusy as exc:
            now = time.monotonic()
            stats.engine_busy += 1
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
            self._write_failed(claim, f"{name} stayed busy for {waited:.1f}s: {exc}")
            return None
        except Exception as exc:
            if isinstance(exc, PartialSubmit):
                partial = Submitted(exc.job, exc.submitted)
                peer.writes_in_flight += partial.writes
                claim.jobs.append(partial)
            logger.warning("kvfsm %s: submitting %d writes failed: %s", name, len(writes), exc)
            stats.engine_failures += 1
            self._write_failed(claim, f"{name} submit failed: {exc}")
            return None
        claim.busy_since = None
        stats.jobs_submitted += 1
        stats.writes_submitted += len(writes)
        submitted = Submitted(job, len(writes))
        peer.writes_in_flight += submitted.writes
        claim.jobs.append(submitted)
        return submitted

    def _write_failed(self, claim: Claim, message: str) -> None:
        """A write of `claim` failed: stop it here and now, tell the decode, then fail its room (rule 14)."""
        reason = FailureReason(FailureKind.TRANSFER_ERROR, message)
        claim.stopped = True
        claim.chunks.clear()
        with self.owner._lock:
            self.owner._fail_claim(claim, "fail", reason)
        if claim.handle is not None:
            claim.handle.fail(reason)

    def _drained(self, claim: Claim) -> None:
        """Every write of a stopped claim ended: ACK (unless one may still land), report, forget."""
        claim.chunks.clear()
        if claim.undrained:
            logger.warning(
                "kvfsm %s room %r: a failed write may still land; no ABORT_ACK, the drain deadline decides",
                self.owner.name,
                claim.room,
            )
            return
        with self.owner._lock:
            row = step(wire.CLAIM_TABLE, claim, "drained")
            if row is not None:
                self.owner._emit(claim.session, row, claim.fields)
            self.owner._drop_if_done(claim)
        handle = claim.handle
        if handle is not None:
            handle.writes_drained()
