"""The prefill (sender) half of a remote endpoint: claims, room ids, and what the decodes say.

A prefill answers each decode's HELLO with a half-open session (bounded,
see `_sessions`); the decode's first frame confirms it, and the prefill
answers that with a HEARTBEAT at once (the decode's session is up only
then) and gives the session its writer lane (`_remote_writer.Lane`), where
the decode's engine peer is opened and every write to it goes. A HELLO
that cannot be kept (every session confirmed, or a half-open one evicted
by a newer HELLO) is answered with BYE, which a decode still in its
handshake reads as "try again". It pairs each decode's claim (ROOM: its
session, room id, generation, pages and aux slot) with its scheduler's
`bootstrap()` of that room id, in whichever order they come. Two kinds of
wire record, each moved only through its table in `wire`:

* a `Claim` per (session, room, gen), kept until none of its writes is in
  flight (rule 13), even after the prefill closed the room;
* a `Slot` per room id: the open prefill generation, early claims and
  early aborts waiting for it, or the hold of an id whose generation ended
  unclaimed (ORPHANED, see `wire` for why).

A claim binds only when exactly one claim and one prefill generation can
belong together; every ambiguity fails both. The lanes (`_remote_writer`)
do the engine work of bound claims, each for its own decode; this half only
queues it and answers ABORTs, with ABORT_ACK only when nothing is in flight.
Its housekeeping also watches the lanes: a decode whose lane has been
inside one engine call for longer than `RemoteConfig.engine_call_timeout`
is told (ABORT for each room, then BYE) and its session lost, its rooms
failed, while the other lanes never noticed.

The commit marker (rule 14): the aux source slot may be named with any
chunk (the last one named counts). A decode that asked for an aux slot gets
its room completed only with that slot written; a last chunk when no chunk
named an aux source, or naming one for a decode that asked for none, fails
the room at the call (as every backend does, see `KVBackend.send`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from typing import Any

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll, Role
from . import codec, wire
from ._markers import MARKER_BYTES, markers_from_fields
from ._remote_endpoint import Fire, RemoteEndpoint, SeenClaims, peer_reason, pools_from_fields, step
from ._remote_engine import Write, coalesce_runs, page_writes
from ._remote_writer import Chunk, Claim, Lane
from ._sessions import Session, SessionState

__all__ = ["PrefillEndpoint", "Slot"]

logger = logging.getLogger("kvfsm.backends.remote")

_C = wire.PrefillClaim
_R = wire.PrefillRoom
#: Room ids whose last bootstrapped generation a prefill remembers (as the manager's tombstones).
_REMEMBER_BOOTSTRAPS = 65536


class Slot:
    """One room id on the prefill: its open generation and what waits for it, or its hold."""

    __slots__ = ("aborts", "claim", "early", "handle", "orphaned_at", "reason", "room", "wire")

    def __init__(self, room: Any) -> None:
        self.room = room
        self.wire: wire.PrefillRoom | None = None
        self.handle: TransferHandle | None = None
        self.claim: Claim | None = None
        #: Claims that came before bootstrap(): more than one means nobody can tell which is ours.
        self.early: list[Claim] = []
        #: (session, gen, reason) of decodes that failed before claiming.
        self.aborts: list[tuple[Session, int, FailureReason]] = []
        self.orphaned_at = 0.0
        self.reason: FailureReason | None = None

    @property
    def empty(self) -> bool:
        return self.wire is None and not self.early and not self.aborts


class Pending:
    """Early claims and early aborts held for room ids not bootstrapped here yet.

    Fed by the network, so bounded three ways (rule 15): per session
    (`max_pending_per_session`), in all (`max_pending`) and in the pages
    the early claims list (`max_pending_pages`); past a bound the oldest
    entries go first (the session's own, for its bound). Kept in arrival
    order, which is also expiry order (one time-to-live).
    """

    def __init__(self, per_session: int, total: int, pages: int) -> None:
        self.per_session, self.total, self.max_pages = per_session, total, pages
        # Keyed by (session id, (room, gen)): a session's sid is never reused, unlike id(session).
        self._items: OrderedDict[tuple[str, Any], tuple[float, Slot, Any]] = OrderedDict()
        # Each session's keys, oldest first; a key removed meanwhile is skipped when met.
        self._order: dict[str, deque[tuple[str, Any]]] = {}
        self._count: Counter[str] = Counter()
        self.pages = 0

    def __len__(self) -> int:
        return len(self._items)

    def holds(self, session: Session, key: tuple[Any, int]) -> bool:
        return (session.sid, key) in self._items

    def admit(self, session: Session, pages: int) -> list[tuple[Slot, Any]] | None:
        """Make room for one more entry of `session` listing `pages` pages.

        Returns the older entries dropped to make it (the caller refuses or
        forgets them), or None when this one cannot be held at all.
        """
        if pages > self.max_pages:
            return None
        dropped = []
        owner = session.sid
        order = self._order.get(owner)
        while order and self._count[owner] >= self.per_session:
            key = order.popleft()
            if key in self._items:
                dropped.append(self._pop(key))
        while self._items and (len(self._items) >= self.total or self.pages + pages > self.max_pages):
            dropped.append(self._pop(next(iter(self._items))))
        return dropped

    def add(self, session: Session, key: tuple[Any, int], now: float, slot: Slot, item: Any) -> None:
        entry, owner = (session.sid, key), session.sid
        self._items[entry] = (now, slot, item)
        order = self._order.setdefault(owner, deque())
        order.append(entry)
        self._count[owner] += 1
        if len(order) > 2 * self._count[owner] + 16:
            # Keys removed meanwhile (claims bound at bootstrap) only linger until here: amortised O(1).
            self._order[owner] = deque(k for k in order if k in self._items)
        if isinstance(item, Claim):
            self.pages += len(item.pages)

    def remove(self, session: Session, key: tuple[Any, int]) -> None:
        if (session.sid, key) in self._items:
            self._pop((session.sid, key))

    def expired(self, now: float, ttl: float) -> list[tuple[Slot, Any]]:
        out = []
        while self._items:
            key, (since, _slot, _item) = next(iter(self._items.items()))
            if now - since <= ttl:
                break
            out.append(self._pop(key))
        return out

    def _pop(self, key: tuple[str, Any]) -> tuple[Slot, Any]:
        _since, slot, item = self._items.pop(key)
        owner = key[0]
        self._count[owner] -= 1
        if self._count[owner] <= 0:
            del self._count[owner]
            self._order.pop(owner, None)
        if isinstance(item, Claim):
            self.pages -= len(item.pages)
        return slot, item


class PrefillEndpoint(RemoteEndpoint):
    """HELLO, ROOM and ABORT at a prefill, its scheduler's bootstrap, send, stop and close, and its lanes."""

    sends = wire.Sender.PREFILL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        self._seen: dict[str, SeenClaims] = {}
        # room id -> the last generation bootstrap() was called for (to recognise one that never was).
        self._bootstrapped: OrderedDict[Any, int] = OrderedDict()
        # (room, prefill generation) -> its bound claim, until the claim is forgotten.
        self._claim_of: dict[tuple[Any, int], Claim] = {}
        self._slots: dict[Any, Slot] = {}
        self._pending = Pending(config.max_pending_per_session, config.max_pending, config.max_pending_pages)
        self._orphans: OrderedDict[Any, Slot] = OrderedDict()
        self._write_budget = config.max_writes_in_flight or self.engine.max_writes_in_flight
        # Each confirmed decode session's writer lane, by session id, until it ended.
        self._lanes: dict[str, Lane] = {}
        # Whether lanes get threads of their own (remote.py); else `pump()` runs them (tests).
        self.threaded = False

    def _timeout_fails(self) -> bool:
        return self.host._timeout_fails()

    # -- HELLO --------------------------------------------------------------------------------

    def _on_hello(self, frame: codec.Frame, nbytes: int) -> None:
        """A decode's HELLO: answer with a half-open session; its engine peer waits for confirmation.

        Nothing of the engine is touched until the decode proves, with its
        first frame of the session, that it received our answer at the
        address it named (`_heard`): a HELLO naming someone else's address
        costs one bounded half-open session and nothing more. A HELLO that
        cannot be kept is answered with BYE, as is the half-open session it
        evicts: both decodes try again instead of waiting for a window.
        """
        problem = None
        pools = None
        markers = None
        if frame["role"] != Role.RECEIVER.value:
            problem = f"a HELLO comes from a decode (receiver); this one says it is {frame['role']!r:.40}"
        elif frame["engine"] != self.name:
            problem = f"engine {frame['engine']!r:.40} cannot talk to this {self.name!r} endpoint"
        else:
            try:
                pools = pools_from_fields(frame["session"].get("pools"))
                markers = markers_from_fields(frame["session"].get("markers"))
            except (TypeError, ValueError) as exc:
                problem = f"bad session: {exc}"
        if problem is None and self.pools is not None and pools is not None:
            problem = self._layout_mismatch(pools, frame["session"])
        try:
            channel = self.transport.connect(frame["addr"])
        except Exception as exc:  # ZeroMQ refuses an address it cannot parse
            self.transport.stats.malformed += 1
            logger.debug("kvfsm %s: HELLO with an unusable address %r dropped: %s", self.name, frame["addr"], exc)
            return
        fire: Fire = []
        with self._lock:
            try:
                session, evicted = self.sessions.open(frame["addr"], SessionState.HALF_OPEN, nbytes)
            except OverflowError as exc:
                logger.warning("kvfsm %s: HELLO from %s not accepted: %s", self.name, frame["addr"], exc)
                self.remote_stats.hellos_dropped += 1
                # Authenticated with the ids the HELLO gave: only that decode can read it as its own.
                bye = codec.encode("BYE", {"sid": frame["reply_sid"], "key": frame["reply_key"]})
                self.transport.send(channel, bye)
                self.transport.close_channel(channel, flush=True)
                return
            for old in evicted:
                self._evict(old, fire)
            session.peer_sid, session.peer_key = frame["reply_sid"], frame["reply_key"]
            session.pools, session.refused = pools, problem
            session.markers = markers
            # Only with an engine that carries notifications, and a region to check slots against.
            session.notify = markers is not None and self.engine.notifies and frame["session"].get("notify") is True
            session.hello = (frame["session"], frame.blob)
            session.records = {}
            self._seen[session.sid] = SeenClaims()
            session.channel = channel
            fields, blob = self._session_fields()
            ack: dict[str, Any] = {
                "reply_sid": session.sid,
                "reply_key": session.key,
                "role": self.role.value,
                "engine": self.name,
                "session": fields,
                "refused": problem or "",
            }
            self.transport.send(channel, self._handshake_frames("HELLO_ACK", {**session.auth, **ack}, blob))
            if problem is not None:
                self.remote_stats.sessions_refused += 1
                logger.warning("kvfsm %s: HELLO from %s refused: %s", self.name, frame["addr"], problem)
        for event in fire:
            event()

    def _evict(self, session: Session, fire: Fire) -> None:
        """Drop a half-open session to make room, and tell its decode to try again (lock held)."""
        channel, session.channel = session.channel, None
        if channel is not None:
            self.transport.send(channel, codec.encode("BYE", session.auth))
            self.transport.close_channel(channel, flush=True)
        self._lose(session, "evicted: too many unconfirmed sessions", fire)

    def _heard(self, session: Session, frame: codec.Frame, fire: Fire) -> bool:
        """The decode's first frame of `session`: it is up; answer at once, give it its lane (lock held).

        Its engine peer is opened in the lane, not here: nothing that may
        block about one decode runs on the thread every decode's frames go
        through.
        """
        if session.state is not SessionState.HALF_OPEN:
            return True
        self.sessions.promote(session)
        hello, session.hello = session.hello, None
        assert hello is not None
        lane = Lane(self, session, self._write_budget, hello)
        session.lane = lane
        self._lanes[session.sid] = lane
        if self.threaded:
            lane.start()
        # The decode's session is up when this arrives: its rooms bootstrap, its claims follow.
        self._send_frame(session, "HEARTBEAT", {})
        return True

    def _lane_broken(self, lane: Lane, why: str) -> None:
        """The decode's engine peer could not be opened: refuse the session (from the lane, lock not held)."""
        fire: Fire = []
        with self._lock:
            session = lane.session
            if session.state is not SessionState.CLOSED:
                self.remote_stats.sessions_refused += 1
                self._abort_and_lose(session, why, fire)
        for event in fire:
            event()

    def _abort_and_lose(self, session: Session, why: str, fire: Fire) -> None:
        """Tell a live decode why its rooms fail (ABORT each, then BYE), and lose the session (lock held)."""
        reason = FailureReason(FailureKind.TRANSFER_ERROR, f"prefill {self.address}: {why}")
        for claim in list(session.records.values()):
            before = claim.wire
            if before in (_C.BOUND, _C.WRITING):
                self._fail_claim(claim, "fail", reason)
                handle = claim.handle
                if handle is not None:
                    fire.append(functools.partial(handle.fail, reason))
        self._send_frame(session, "BYE", {})
        self._lose(session, why, fire)

    def _lane_ended(self, lane: Lane) -> None:
        with self._lock:
            if self._lanes.get(lane.session.sid) is lane:
                del self._lanes[lane.session.sid]

    def pump(self) -> bool:
        """Run one turn of every lane (the model-based test's writer; threads do it in production)."""
        moved = False
        for lane in list(self._lanes.values()):
            moved |= bool(lane.pump())
        return moved

    @property
    def lanes(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes.values())

    def lanes_idle(self, wait: float) -> bool:
        """True when every lane took up every command queued so far and had no work left (threaded)."""
        events = []
        for lane in self.lanes:
            done = threading.Event()
            lane.put("sync", done)
            events.append(done)
        return all(event.wait(wait) for event in events)

    def shutdown(self) -> None:
        lanes = self.lanes
        for lane in lanes:
            lane.put("exit")
        # 5 s for all of them, not each: a lane stuck in an engine call is left behind (a daemon thread).
        deadline = time.monotonic() + 5.0
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(max(0.0, deadline - time.monotonic()))

    # -- the scheduler's calls ------------------------------------------------------------------

    def bootstrap(self, handle: TransferHandle, peer: str) -> None:
        fire: Fire = []
        with self._lock:
            self._expire(self._clock_now(), fire)
            slot = self._slots.get(handle.room)
            if slot is not None:
                self._catch_up(slot, fire)
                slot = self._slots.get(handle.room)
            if slot is None:
                slot = self._slots[handle.room] = Slot(handle.room)
            slot.handle = handle
            reason = self._unseen_generation(handle) or self._refusal(slot)
            self._bootstrapped[handle.room] = handle.generation
            self._bootstrapped.move_to_end(handle.room)
            while len(self._bootstrapped) > _REMEMBER_BOOTSTRAPS:
                self._bootstrapped.popitem(last=False)
            if reason is not None:
                step(wire.ROOM_TABLE, slot, "bootstrap: refuse")
                self._orphans.pop(slot.room, None)
                slot.reason = reason
                for claim in self._take_early(slot):
                    self._refuse_claim(claim, "refuse", reason)
                slot.aborts.clear()
                fire.append(lambda: handle.fail(reason))
            elif slot.early:
                claim = self._take_early(slot)[0]
                step(wire.ROOM_TABLE, slot, "bootstrap: bind")
                self._bind(slot, claim, "bind")
                fire.append(handle.bootstrapped)
            else:
                step(wire.ROOM_TABLE, slot, "bootstrap")
        for event in fire:
            event()

    def _unseen_generation(self, handle: TransferHandle) -> FailureReason | None:
        """A refusal if an earlier generation of this room id was opened and closed here, unseen, lately.

        Such a generation never reached this backend (no `bootstrap()`), so
        no slot held its id; its decode may still claim it, just like one of
        a generation that ended unclaimed (see `wire`).
        """
        closed = self.manager.last_closed(handle.room)
        if closed is None:
            return None
        generation, _state, ended = closed
        if self._bootstrapped.get(handle.room) == generation:
            return None  # it reached us: its slot decided
        if ended is not None and self._clock_now() - ended > self.config.pending_ttl:
            return None
        self.remote_stats.held_room_refusals += 1
        return FailureReason(
            FailureKind.BOOTSTRAP_ERROR,
            f"room id {handle.room!r} was reused within pending_ttl ({self.config.pending_ttl:g}s) of generation "
            f"{generation}, which closed without bootstrap(): a claim for it cannot be told from one for this generation",
        )

    def _refusal(self, slot: Slot) -> FailureReason | None:
        """Why a new generation of `slot`'s room id cannot be paired with any claim, or None."""
        if slot.wire is _R.ORPHANED:
            self.remote_stats.held_room_refusals += 1
            return FailureReason(
                FailureKind.BOOTSTRAP_ERROR,
                f"room id {slot.room!r} was reused within pending_ttl ({self.config.pending_ttl:g}s) of a generation "
                "that ended before its decode claimed it: a claim for it cannot be told from one for this generation",
            )
        if slot.aborts:
            _session, _gen, reason = slot.aborts[0]
            return reason
        if len(slot.early) > 1:
            self.remote_stats.ambiguous_claims += 1
            return FailureReason(
                FailureKind.BOOTSTRAP_ERROR,
                f"{len(slot.early)} decodes claimed room id {slot.room!r} before it was bootstrapped: "
                "which one is this generation's cannot be told",
            )
        return None

    def _take_early(self, slot: Slot) -> list[Claim]:
        claims, slot.early = slot.early, []
        for claim in claims:
            self._pending.remove(claim.session, (claim.room, claim.gen))
        return claims

    def claim_peer(self, handle: TransferHandle) -> dict[str, Any] | None:
        """The engine session fields (its HELLO's) of the decode whose claim is bound to this room; None until one is.

        A compat layer that fans one request out to several decode ranks
        learns from it who claimed the room.
        """
        with self._lock:
            claim = self._claim_of.get((handle.room, handle.generation))
            lane = None if claim is None else claim.session.lane
            return None if lane is None else lane.peer_session

    def _kv_writes(self, lane: Lane, src: list[int], dst: list[int]) -> list[Write]:
        """The engine writes that put our pages `src` into the decode's pages `dst` (pairwise, in order).

        Whole pages, runs coalesced. A half with another geometry (see
        `_layout_mismatch`) overrides both; `lane.peer_session` is what the
        decode said of itself.
        """
        assert self.pools is not None and lane.session.pools is not None
        return page_writes(self.pools.kv, lane.session.pools.kv, coalesce_runs(src, dst))

    def expected_pages(self, handle: TransferHandle) -> int | None:
        with self._lock:
            claim = self._claim_of.get((handle.room, handle.generation))
            return None if claim is None else len(claim.pages)

    def send(self, handle: TransferHandle, pages: list[int], last: bool, aux_index: int | None) -> None:
        problem = None
        chunk: Chunk | None = None
        with self._lock:
            slot = self._slots.get(handle.room)
            claim = slot.claim if slot is not None and slot.handle is handle else None
            if claim is not None and not claim.stopped:
                start, end = claim.cursor, claim.cursor + len(pages)
                aux_src = claim.aux_src if aux_index is None else aux_index
                if end > len(claim.pages) or (last and end != len(claim.pages)):
                    problem = (
                        f"the decode expects {len(claim.pages)} pages; this chunk would bring the total to {end}"
                        + (" and it is the last" if last else "")
                    )
                elif last and claim.aux is not None and aux_src is None:
                    problem = (
                        f"the decode expects its commit marker in aux slot {claim.aux}, and no chunk named "
                        "a source aux slot (aux_index)"
                    )
                elif last and claim.aux is None and aux_src is not None:
                    problem = f"aux_index {aux_src} given but the receiver posted no aux slot"
                elif step(wire.CLAIM_TABLE, claim, "send") is not None:
                    claim.cursor = end
                    claim.aux_src = aux_src
                    assert self.pools is not None
                    nbytes = len(pages) * self.pools.page_nbytes
                    chunk = Chunk(pages, claim.pages[start:end], last, aux_index, nbytes)
        if problem is not None:
            self._reject(handle, problem)
        if claim is None:
            # Not bootstrapped: the table decides (transfer_started out of order fails the room closed).
            handle.transfer_started()
            return
        if chunk is not None:
            # Transferring before the writer sees the chunk: it completes only a Transferring room.
            if handle.state is KVPoll.WaitingForInput:
                handle.transfer_started()
            claim.session.lane.put("chunk", (claim, chunk))

    def stop(self, handle: TransferHandle) -> None:
        with self._lock:
            drained = self._stop_locked(handle)
        if drained:
            handle.writes_drained()

    def _stop_locked(self, handle: TransferHandle) -> bool:
        """The room of `handle` failed: step its claim or slot; True when nothing of it is in flight.

        Idempotent: a stop caught up with early (`_catch_up`) and the notice's
        own stop later step the same rows once.
        """
        claim = self._claim_of.get((handle.room, handle.generation))
        if claim is not None:
            return self._fail_claim(claim, "fail", handle.reason)
        slot = self._slots.get(handle.room)
        if slot is not None and slot.handle is handle and slot.wire is _R.UNCLAIMED:
            step(wire.ROOM_TABLE, slot, "fail")
            slot.reason = handle.reason
        return True

    def _catch_up(self, slot: Slot, fire: Fire) -> None:
        """Apply what the manager's notices have not told us yet about `slot`'s generation (lock held).

        Notices reach the backend after the manager's lock, possibly on
        another thread, so a generation may be failed or even closed while
        its slot still says UNCLAIMED: a claim must never bind to it, and a
        new generation of the id must not inherit its slot.
        """
        handle = slot.handle
        if handle is None:
            return
        if handle.state is KVPoll.Failed and self._stop_locked(handle):
            fire.append(handle.writes_drained)
        if handle.closed:
            self._forget_locked(handle)

    def _fail_claim(self, claim: Claim, input: str, reason: FailureReason | None) -> bool:
        """Step a bound claim whose room failed; True when nothing of it is in flight (lock held)."""
        row = step(wire.CLAIM_TABLE, claim, input)
        if row is not None:
            self._emit(claim.session, row, lambda kind: claim.fields(kind, reason))
        if claim.wire is _C.STOPPING:
            if not claim.stopped:
                claim.stopped = True
                claim.session.lane.put("stop", claim)
            return False
        return claim.wire is not _C.WRITING

    def forget(self, handle: TransferHandle) -> None:
        with self._lock:
            self._forget_locked(handle)

    def _forget_locked(self, handle: TransferHandle) -> None:
        claim = self._claim_of.get((handle.room, handle.generation))
        if claim is not None:
            claim.room_closed = True
            self._drop_if_done(claim)
        slot = self._slots.get(handle.room)
        if slot is None or slot.handle is not handle:
            return
        step(wire.ROOM_TABLE, slot, "close")
        slot.handle = None
        slot.claim = None
        if slot.wire is _R.ORPHANED and not self._holds_unclaimed(slot):
            step(wire.ROOM_TABLE, slot, "expire")
        if slot.wire is _R.ORPHANED:
            slot.orphaned_at = self._clock_now()
            self._orphans.pop(slot.room, None)
            self._orphans[slot.room] = slot
        elif slot.empty:
            del self._slots[handle.room]

    def _holds_unclaimed(self, slot: Slot) -> bool:
        """Whether a room id closed before any claim is held for `pending_ttl` (always: see `wire`).

        Forgetting it at once would let the closed generation's late claim
        bind to the next generation of the id: defect 1 of issue 11, which
        the model-based test re-introduces through this method.
        """
        return True

    def _drop_if_done(self, claim: Claim) -> None:
        """Forget a claim once its room closed and nothing of it is in flight (lock held)."""
        if claim.room_closed and step(wire.CLAIM_TABLE, claim, "forget") is not None:
            claim.session.records.pop((claim.room, claim.gen), None)
            if claim.handle is not None:
                self._claim_of.pop((claim.room, claim.handle.generation), None)
            seen = self._seen.get(claim.session.sid)
            if seen is not None:
                seen.add(claim.gen)

    # -- frames ---------------------------------------------------------------------------------

    def _on_frame(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        if frame.type == "ROOM":
            self._on_room(session, frame, fire)
        elif frame.type == "ABORT":
            self._on_abort(session, frame, fire)
        else:
            self.remote_stats.stale_messages += 1

    def _on_room(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        room, gen, pages, aux, marker = frame["room"], frame["gen"], frame["pages"], frame["aux"], frame["marker"]
        key = (room, gen)
        seen = self._seen.get(session.sid)
        if key in session.records or (seen is not None and gen in seen):
            self.remote_stats.stale_messages += 1  # a duplicate or a replay of a finished claim
            return
        claim = Claim(session, room, gen, list(pages), aux)
        if marker is not None and session.markers is not None and marker[0] < session.markers[1]:
            claim.marker = (session.markers[0] + marker[0] * MARKER_BYTES, marker[1])
        session.records[key] = claim
        slot = self._slots.get(room)
        if slot is not None:
            self._catch_up(slot, fire)
            slot = self._slots.get(room)
        assert session.pools is not None
        problem: FailureReason | None = None
        if any(p >= session.pools.num_pages for p in pages):
            problem = self._bootstrap_error(
                f"a destination page is out of range (the decode has {session.pools.num_pages})"
            )
        elif len(set(pages)) != len(pages):
            problem = self._bootstrap_error("the destination pages repeat a page")
        elif aux is not None and aux >= session.pools.num_aux_slots:
            problem = self._bootstrap_error(
                f"aux slot {aux} is out of range (the decode has {session.pools.num_aux_slots})"
            )
        elif marker is not None and (session.markers is None or marker[0] >= session.markers[1]):
            slots = 0 if session.markers is None else session.markers[1]
            problem = self._bootstrap_error(
                f"commit-marker slot {marker[0]} is out of range (the decode named {slots} marker slots)"
            )
        elif slot is not None and slot.wire is _R.ORPHANED:
            self.remote_stats.held_room_refusals += 1
            problem = slot.reason or FailureReason(FailureKind.ABORTED, "the prefill closed this room before the claim")
        elif slot is not None and slot.wire is _R.FAILED:
            problem = slot.reason or FailureReason(FailureKind.ABORTED, "the prefill's room failed before the claim")
        elif slot is not None and slot.wire is _R.CLAIMED:
            self.remote_stats.duplicate_rooms += 1
            problem = self._bootstrap_error(f"room {room!r} is in use by another transfer on this prefill")
        if problem is not None:
            self.remote_stats.rejected_rooms += 1
            self._refuse_claim(claim, "recv ROOM: refuse", problem)
            return
        if slot is not None and slot.wire is _R.UNCLAIMED:
            handle = slot.handle
            assert handle is not None
            step(wire.ROOM_TABLE, slot, "claim")
            self._bind(slot, claim, "recv ROOM: bind")
            fire.append(handle.bootstrapped)
            return
        if not self._admit_pending(session, len(pages)):
            self._refuse_claim(
                claim, "recv ROOM: refuse", self._bootstrap_error("too many claims wait for this prefill")
            )
            return
        step(wire.CLAIM_TABLE, claim, "recv ROOM: hold")
        slot = self._slots.get(room)  # admitting may have dropped an older, empty one
        if slot is None:
            slot = self._slots[room] = Slot(room)
        slot.early.append(claim)
        self._pending.add(session, key, self._clock_now(), slot, claim)

    def _bootstrap_error(self, text: str) -> FailureReason:
        return FailureReason(FailureKind.BOOTSTRAP_ERROR, text)

    def _bind(self, slot: Slot, claim: Claim, input: str) -> None:
        assert slot.handle is not None
        step(wire.CLAIM_TABLE, claim, input)
        claim.handle = slot.handle
        claim.pgen = slot.handle.generation
        slot.claim = claim
        self._claim_of[(claim.room, claim.pgen)] = claim

    def _refuse_claim(self, claim: Claim, input: str, reason: FailureReason) -> None:
        """Refuse a claim: ABORT and ABORT_ACK (nothing was written for it), and forget it (lock held)."""
        row = step(wire.CLAIM_TABLE, claim, input)
        if row is not None:
            self._emit(claim.session, row, lambda kind: claim.fields(kind, reason))
        logger.info("kvfsm %s: claim of room %r from %s refused: %s", self.name, claim.room, claim.session.addr, reason)
        claim.room_closed = True
        self._drop_if_done(claim)

    def _admit_pending(self, session: Session, pages: int) -> bool:
        """Room for one more early claim (of `pages` pages) or abort of `session` (lock held)."""
        dropped = self._pending.admit(session, pages)
        if dropped is None:
            self.remote_stats.pending_dropped += 1
            return False
        for slot, item in dropped:
            self.remote_stats.pending_dropped += 1
            self._drop_pending(slot, item)
        return True

    def _drop_pending(self, slot: Slot, item: Any) -> None:
        if isinstance(item, Claim):
            if item in slot.early:
                slot.early.remove(item)
            self._refuse_claim(item, "expire", self._bootstrap_error("not bootstrapped here within pending_ttl"))
        elif item in slot.aborts:
            slot.aborts.remove(item)
        if slot.empty:
            self._slots.pop(slot.room, None)

    def _on_abort(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        room, gen = frame["room"], frame["gen"]
        key = (room, gen)
        claim = session.records.get(key)
        reason = peer_reason(session, frame)
        if claim is None:
            seen = self._seen.get(session.sid)
            if seen is not None and gen in seen:
                # Its record was dropped only once nothing of it was in flight: provably quiet.
                self.remote_stats.abort_acks_sent += 1
                self._send_frame(session, "ABORT_ACK", {"room": room, "gen": gen, "pgen": None})
                return
            # The decode failed before it claimed: nothing of it was ever written here.
            slot = self._slots.get(room)
            if slot is not None:
                self._catch_up(slot, fire)
                slot = self._slots.get(room)
            if slot is not None and slot.wire is _R.UNCLAIMED and slot.handle is not None:
                step(wire.ROOM_TABLE, slot, "fail")
                slot.reason = reason
                handle = slot.handle
                fire.append(lambda: handle.fail(reason))
            elif slot is None or slot.wire is None:
                if self._pending.holds(session, key):
                    self.remote_stats.stale_messages += 1  # a duplicate of an early abort held already
                    return
                if not self._admit_pending(session, 0):
                    return
                slot = self._slots.get(room)
                if slot is None:
                    slot = self._slots[room] = Slot(room)
                item = (session, gen, reason)
                slot.aborts.append(item)
                self._pending.add(session, key, self._clock_now(), slot, item)
            return
        if frame["pgen"] is not None and claim.pgen is not None and frame["pgen"] != claim.pgen:
            self.remote_stats.wrong_generation += 1
            return
        before = claim.wire
        row = wire.CLAIM_TABLE.row(claim.wire, "recv ABORT")
        if row is None:
            self.remote_stats.stale_messages += 1
            return
        if before is _C.EARLY:
            slot = self._slots.get(room)
            self._pending.remove(session, key)
            if slot is not None and claim in slot.early:
                slot.early.remove(claim)
                item = (session, gen, reason)
                slot.aborts.append(item)
                self._pending.add(session, key, self._clock_now(), slot, item)
        drained = self._fail_claim(claim, "recv ABORT", None)
        handle = claim.handle
        if handle is not None and before in (_C.BOUND, _C.WRITING):
            fire.append(lambda: handle.fail(reason))
        if drained:
            self._drop_if_done(claim)
        if before is _C.EARLY:
            claim.room_closed = True
            self._drop_if_done(claim)

    # -- lost sessions and expiries -----------------------------------------------------------------

    def _session_lost(self, session: Session, was: SessionState, why: str, fire: Fire) -> None:
        reason = FailureReason(FailureKind.PEER_LOST, f"decode {session.addr} lost: {why}")
        for claim in list(session.records.values()):
            before = claim.wire
            if before is _C.EARLY:
                slot = self._slots.get(claim.room)
                self._pending.remove(session, (claim.room, claim.gen))
                if slot is not None and claim in slot.early:
                    slot.early.remove(claim)
                    if slot.empty:
                        del self._slots[claim.room]
            self._fail_claim(claim, "session_lost", None)
            handle = claim.handle
            if handle is not None and before in (_C.BOUND, _C.WRITING):
                fire.append(functools.partial(handle.fail, reason))
            if claim.wire is _C.ACKED:
                session.records.pop((claim.room, claim.gen), None)
        self._seen.pop(session.sid, None)
        if session.lane is not None:
            # It ends once nothing of the session is in flight, and removes the engine peer then.
            session.lane.put("close")

    def _expire(self, now: float, fire: Fire) -> float | None:
        self._watch_lanes(now, fire)
        ttl = self.config.pending_ttl
        for slot, item in self._pending.expired(now, ttl):
            self._drop_pending(slot, item)
        while self._orphans:
            room, slot = next(iter(self._orphans.items()))
            if now - slot.orphaned_at <= ttl:
                break
            del self._orphans[room]
            if slot.wire is _R.ORPHANED and step(wire.ROOM_TABLE, slot, "expire") is not None:
                slot.reason = None
                if slot.empty and self._slots.get(room) is slot:
                    del self._slots[room]
        return None

    def _watch_lanes(self, now: float, fire: Fire) -> None:
        """Lose the decodes whose lane has been inside one engine call for too long (lock held)."""
        limit = self.config.engine_call_timeout
        for lane in list(self._lanes.values()):
            stuck = lane.stuck_for(now)
            session = lane.session
            if stuck <= limit or session.state is SessionState.CLOSED:
                continue
            self.remote_stats.engine_calls_stuck += 1
            why = f"an engine call about it ({lane.call_what}) has not returned for {stuck:.1f}s (limit {limit:g}s)"
            logger.warning("kvfsm %s: decode %s: %s", self.name, session.addr, why)
            self._abort_and_lose(session, why, fire)
