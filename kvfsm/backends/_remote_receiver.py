"""The decode (receiver) half of a remote endpoint.

A decode endpoint opens one session per prefill it meets, mints a
generation for every `bootstrap()`, claims the prefill's room with its
pages when the scheduler calls `expect()` (ROOM), and turns what the
prefill's session says back (CHUNK, DONE, ABORT, ABORT_ACK) into lifecycle
events. Each room's wire record moves only by `wire.DECODE_TABLE`; a frame
the table does not take in the record's state is dropped and counted
(`remote_stats.stale_messages`), so a late DONE never reaches a failed
room and a duplicated ABORT_ACK never opens anything.

The handshake (see `wire`): HELLO, the prefill's HELLO_ACK, our HEARTBEAT
to confirm it, and the prefill's HEARTBEAT back. Only that last one puts
the session up and bootstraps its rooms: until then nothing of ours is
sent that the prefill could drop as unauthenticated. A prefill that does
not accept the handshake says BYE (its half-open sessions were full, or
it holds all the sessions it may); so does one that answered but then let
the confirmation lapse, silently, past the window. Either way the decode
tries again with a fresh session after a short, jittered pause,
`RemoteConfig.handshake_attempts` times in all, and then fails the rooms
waiting on it with `BOOTSTRAP_ERROR` at once. A refusal (HELLO_ACK naming
why: another engine, another layout) fails them at once; a prefill that
never answers fails them when the window passes.

Release (rule 13): a failed room is reported drained only when the prefill
cannot write into its pages any more: it never claimed them, or its
ABORT_ACK said none of its writes is in flight, or its DONE said every write
had landed. A lost session leaves that to the drain deadline.

The aux slot: a DONE that carries the aux bytes (both aux pools in host
memory) is copied into the slot under the endpoint's lock before the record
moves to DONE, so a room failed meanwhile is never reported drained while
the copy may still run.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import random
from typing import Any

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll
from . import codec, wire
from ._errors import BackendError
from ._markers import new_token, parse_notification
from ._remote_endpoint import Fire, RemoteEndpoint, new_generation, peer_reason, pools_from_fields, step
from ._sessions import Session, SessionState

__all__ = ["DecodeEndpoint", "RecvRecord"]

logger = logging.getLogger("kvfsm.backends.remote")

_D = wire.DecodeWire
#: States in which the prefill may still write into the room's pages (a notifying engine
#: must be polled then, aborted rooms included, or their writes never end and no ACK comes).
_WRITABLE = frozenset({_D.CLAIMED, _D.RECEIVING, _D.ABORTING, _D.PEER_ABORTED})
#: States in which nothing of the prefill can land any more: release-safe once failed.
_QUIET = frozenset({_D.SETTLED, _D.UNTOLD, _D.DONE})
#: States in which the room's commit marker completes it.
_MARKABLE = frozenset({_D.CLAIMED, _D.RECEIVING})
#: While a notifying engine may be writing into us, poll it this often (seconds).
_BUSY_TICK = 0.0001
#: The pause before a handshake is tried again: this, doubling per attempt, at most
#: `_RETRY_MOST` (and half the window), each drawn from 50% to 150% of it so a burst of
#: decodes refused together does not come back together.
_RETRY_FIRST = 0.02
_RETRY_MOST = 1.0


class RecvRecord:
    """One decode generation of a room: its handle, session, generation and claim."""

    __slots__ = (
        "aux",
        "expected",
        "gen",
        "handle",
        "marked",
        "marker",
        "pages",
        "pgen",
        "room",
        "seen_bytes",
        "seen_chunks",
        "session",
        "wire",
    )

    def __init__(self, handle: TransferHandle, session: Session, room: Any = None) -> None:
        self.handle = handle
        self.session = session
        #: The room id the prefill knows this room by (the handle's own, unless `_wire_room` says otherwise).
        self.room = handle.room if room is None else room
        self.gen = new_generation()
        self.pgen: int | None = None
        self.pages: list[int] = []
        self.aux: int | None = None
        self.expected = False
        self.wire: wire.DecodeWire | None = None
        #: The room's commit-marker slot and the token it waits for there (`_markers`), if it has one.
        self.marker: tuple[int, int] | None = None
        self.marked = False
        #: Bytes and chunks its CHUNKs reported: the marker's counts, less these, are still to count.
        self.seen_bytes = 0
        self.seen_chunks = 0

    def fields(self, kind: str) -> dict[str, Any]:
        base: dict[str, Any] = {"room": self.room, "gen": self.gen}
        if kind == "ROOM":
            marker = None if self.marker is None else list(self.marker)
            return {**base, "pages": self.pages, "aux": self.aux, "marker": marker}
        reason = self.handle.reason
        return {
            **base,
            "pgen": self.pgen,
            "kind": reason.kind.value if reason is not None else FailureKind.ABORTED.value,
            "message": reason.message if reason is not None else "aborted",
        }


class DecodeEndpoint(RemoteEndpoint):
    """Bootstrap, expect, stop and the frames of a decode endpoint."""

    sends = wire.Sender.DECODE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recv_by_handle: dict[tuple[Any, int], RecvRecord] = {}
        # Records the prefill may be writing into (`_WRITABLE`; the engine is polled while any is).
        self._claimed: set[RecvRecord] = set()
        # Claimed records whose marker slot is read (CLAIMED or RECEIVING, with a slot).
        self._watched: set[RecvRecord] = set()
        # Sessions whose (next) HELLO waits for its pause to end.
        self._hellos_due: list[Session] = []
        # Markers come as engine notifications, not into the slots (`_markers`): the engine
        # would not move a marker along once the room's writes ended.
        self._notified = self.markers is not None and self.engine.notifies

    def _session_fields(self) -> tuple[dict[str, Any], bytes | None]:
        fields, blob = super()._session_fields()
        if self._notified:
            fields["notify"] = True  # send each room's commit marker as an engine notification
        return fields, blob

    def _wire_room(self, handle: TransferHandle) -> Any:
        """The room id this room's claim names at the prefill: its own here.

        A compat layer that pulls one request from several prefill ranks
        (or whose decode ranks share one prefill rank) keeps a room per
        rank under ids of its own and names the prefill's room id here.
        """
        return handle.room

    # -- the scheduler's calls ------------------------------------------------------------------

    def bootstrap(self, handle: TransferHandle, peer: str) -> None:
        fire: Fire = []
        with self._lock:
            session = self.sessions.find_up(peer)
            if session is None:
                try:
                    session = self._open_session(peer)
                except (OverflowError, ValueError) as exc:
                    reason = FailureReason(
                        FailureKind.BOOTSTRAP_ERROR, f"no session with the prefill at {peer!r:.200}: {exc}"
                    )
                    fire.append(functools.partial(handle.fail, reason))
            if session is not None:
                rec = RecvRecord(handle, session, self._wire_room(handle))
                step(wire.DECODE_TABLE, rec, "bootstrap")
                session.records[rec.gen] = rec
                self._recv_by_handle[(handle.room, handle.generation)] = rec
                if session.state is SessionState.UP:
                    step(wire.DECODE_TABLE, rec, "session_up")
                    fire.append(handle.bootstrapped)
        for event in fire:
            event()

    def _open_session(self, addr: str, attempt: int = 0, at: float | None = None) -> Session:
        """A new session with the prefill at `addr`; its HELLO goes out now, or at `at` (lock held)."""
        try:
            channel = self.transport.connect(addr)
        except Exception as exc:  # ZeroMQ refuses an address it cannot parse
            raise ValueError(f"cannot connect: {exc}") from None
        try:
            session, _evicted = self.sessions.open(addr, SessionState.HANDSHAKE)
        except OverflowError:
            self.transport.close_channel(channel)
            raise
        session.channel = channel
        session.attempt = attempt
        if at is None:
            self._say_hello(session)
        else:
            # Silent from the pause's end, not from now: the window counts from the HELLO.
            session.hello_at = session.last_seen = at
            self._hellos_due.append(session)
        return session

    def _say_hello(self, session: Session) -> None:
        fields, blob = self._session_fields()
        hello: dict[str, Any] = {
            "addr": self.address,
            "reply_sid": session.sid,
            "reply_key": session.key,
            "role": self.role.value,
            "engine": self.name,
            "session": fields,
        }
        session.hello_at = None
        session.last_seen = self._clock_now()
        self.transport.send(session.channel, self._handshake_frames("HELLO", hello, blob))

    def expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        with self._lock:
            rec = self._recv_by_handle.get((handle.room, handle.generation))
            if rec is None:
                raise BackendError(f"room {handle.room!r}: expect() before bootstrap()")
            if rec.expected:
                # The claim with the first pages went out: the prefill writes there, whatever we say now.
                problem: str | None = f"expect() was already called ({len(rec.pages)} pages)"
            elif len(pages) > wire.MAX_PAGES:
                problem = f"{len(pages)} destination pages; one room can claim at most {wire.MAX_PAGES}"
            else:
                problem = None
                rec.expected = True
                rec.pages, rec.aux = pages, aux_index
                # Not written by an engine whose incoming writes need our polling (NIXL without its
                # progress thread): once the room is done nothing would progress a marker still on its
                # way, and the prefill's write of it would never end. Such an engine's marker comes
                # as its notification, where it can (`_notified`).
                marks = self.markers is not None and (self._notified or not self.engine.receiver_progress)
                slot = self.markers.take() if marks and self.markers is not None else None
                if slot is not None:
                    rec.marker = (slot, new_token())
                row = step(wire.DECODE_TABLE, rec, "expect")
                if row is not None:
                    self._track(rec)
                    self._emit(rec.session, row, rec.fields)
        if problem is not None:
            self._reject(handle, problem)
        if self.engine.receiver_progress or rec.marker is not None:
            self.transport.wake()  # the engine or the marker needs polling from now on, not at the next tick

    def stop(self, handle: TransferHandle) -> None:
        with self._lock:
            rec = self._recv_by_handle.get((handle.room, handle.generation))
            if rec is not None:
                row = step(wire.DECODE_TABLE, rec, "fail")
                if row is not None:
                    self._emit(rec.session, row, rec.fields)
                quiet = rec.wire in _QUIET
                self._track(rec)
        if rec is None or quiet:
            handle.writes_drained()

    def forget(self, handle: TransferHandle) -> None:
        with self._lock:
            rec = self._recv_by_handle.pop((handle.room, handle.generation), None)
            if rec is not None:
                step(wire.DECODE_TABLE, rec, "close")
                rec.session.records.pop(rec.gen, None)
                self._claimed.discard(rec)
                self._watched.discard(rec)
                if rec.marker is not None and self.markers is not None:
                    # Reused at once: a late marker into it carries this room's token, which no later room waits for.
                    self.markers.give(rec.marker[0])

    # -- the handshake ---------------------------------------------------------------------------

    def _on_hello(self, frame: codec.Frame, nbytes: int) -> None:
        self.remote_stats.stale_messages += 1  # a decode takes no HELLO (admit() drops them first)

    def _heard(self, session: Session, frame: codec.Frame, fire: Fire) -> bool:
        """The prefill's first frame after its HELLO_ACK confirms our confirmation: the session is up."""
        if session.state is SessionState.HANDSHAKE and frame.type not in ("HELLO_ACK", "BYE"):
            if not session.answered:
                self.remote_stats.stale_messages += 1
                return False
            self._session_up(session, fire)
        return True

    def _session_up(self, session: Session, fire: Fire) -> None:
        self.sessions.confirm(session)
        for rec in list(session.records.values()):
            row = step(wire.DECODE_TABLE, rec, "session_up")
            if row is None:
                continue
            self._emit(session, row, rec.fields)
            if rec.wire is _D.READY:
                fire.append(rec.handle.bootstrapped)

    def _on_bye(self, session: Session, fire: Fire) -> None:
        if session.state is SessionState.HANDSHAKE:
            self._retry(session, "the prefill did not accept the handshake (BYE)", fire)
            return
        super()._on_bye(session, fire)

    def _on_hello_ack(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        if session.state is not SessionState.HANDSHAKE or session.answered:
            self.remote_stats.stale_messages += 1  # a repeat: the handshake is settled
            return
        problem = frame["refused"] or None
        pools = None
        if problem is None:
            try:
                pools = pools_from_fields(frame["session"].get("pools"))
            except (TypeError, ValueError) as exc:
                problem = f"bad session from the prefill: {exc}"
        if problem is None and frame["engine"] != self.name:
            problem = f"the prefill runs engine {frame['engine']!r:.40}, this decode {self.name!r}"
        if problem is None and self.pools is not None and pools is not None:
            problem = self._layout_mismatch(pools, frame["session"])
        if problem is not None:
            self.remote_stats.sessions_refused += 1
            session.refused = problem
            reason = FailureReason(FailureKind.BOOTSTRAP_ERROR, f"prefill at {session.addr}: {problem}")
            for rec in list(session.records.values()):
                step(wire.DECODE_TABLE, rec, "session_refused")
                fire.append(functools.partial(rec.handle.fail, reason))
            self.sessions.close(session)
            if session.channel is not None:
                self.transport.close_channel(session.channel)
                session.channel = None
            return
        session.peer_sid, session.peer_key = frame["reply_sid"], frame["reply_key"]
        session.pools = pools
        agent = frame["session"].get("agent")
        session.engine_id = agent if isinstance(agent, str) else None
        session.answered = True
        session.last_seen = self._clock_now()
        # Prove at once that we got the answer: the prefill's session is half-open until then,
        # and ours is up only once the prefill answers this (see `_heard`).
        self._send_frame(session, "HEARTBEAT", {})

    def _retry(self, session: Session, why: str, fire: Fire) -> None:
        """The handshake of `session` was not accepted: try a fresh one after a pause, or give up (lock held)."""
        if session.state is not SessionState.CLOSED:
            self.sessions.close(session)
        if session.channel is not None:
            self.transport.close_channel(session.channel)
            session.channel = None
        records = [rec for rec in session.records.values() if rec.wire in (_D.HANDSHAKE, _D.UNTOLD)]
        attempt = session.attempt + 1
        if not records:
            return
        if attempt >= self.config.handshake_attempts:
            reason = FailureReason(
                FailureKind.BOOTSTRAP_ERROR,
                f"prefill at {session.addr} did not accept the handshake in {attempt} attempts: {why}",
            )
            for rec in records:
                step(wire.DECODE_TABLE, rec, "session_refused")
                fire.append(functools.partial(rec.handle.fail, reason))
            return
        pause = min(_RETRY_MOST, self.config.peer_window / 2, _RETRY_FIRST * 2**session.attempt)
        at = self._clock_now() + pause * random.uniform(0.5, 1.5)
        try:
            fresh = self._open_session(session.addr, attempt, at)
        except (OverflowError, ValueError) as exc:
            reason = FailureReason(FailureKind.BOOTSTRAP_ERROR, f"no session with the prefill at {session.addr}: {exc}")
            for rec in records:
                step(wire.DECODE_TABLE, rec, "session_refused")
                fire.append(functools.partial(rec.handle.fail, reason))
            return
        self.remote_stats.handshake_retries += 1
        logger.info("kvfsm %s: handshake with %s tried again (attempt %d): %s", self.name, session.addr, attempt, why)
        for rec in records:
            rec.session = fresh
            fresh.records[rec.gen] = rec
        session.records.clear()

    def _expire(self, now: float, fire: Fire) -> float | None:
        due: float | None = None
        still = []
        for session in self._hellos_due:
            if session.state is not SessionState.HANDSHAKE or session.hello_at is None:
                continue
            if session.hello_at <= now:
                self._say_hello(session)
            else:
                still.append(session)
                due = session.hello_at if due is None else min(due, session.hello_at)
        self._hellos_due = still
        return due

    # -- frames --------------------------------------------------------------------------------

    def _on_frame(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        if frame.type == "HELLO_ACK":
            self._on_hello_ack(session, frame, fire)
            return
        rec = session.records.get(frame["gen"])
        if rec is None or rec.room != frame["room"]:
            self.remote_stats.stale_messages += 1
            return
        pgen = frame["pgen"]
        if pgen is not None:
            if rec.pgen is None:
                rec.pgen = pgen
            elif pgen != rec.pgen:
                self.remote_stats.wrong_generation += 1
                return
        kind = frame.type
        if rec.marked and kind in ("CHUNK", "DONE"):
            return  # the marker completed the room first: these are its expected echoes, not stale
        if wire.DECODE_TABLE.row(rec.wire, f"recv {kind}") is None:
            self.remote_stats.stale_messages += 1
            return
        if kind == "DONE" and not self._copy_aux(rec, frame):
            size = len(frame.blob or b"")
            reason = FailureReason(
                FailureKind.TRANSFER_ERROR,
                f"the prefill's DONE carried {size} aux bytes; the room's aux slot takes another",
            )
            fire.append(lambda: rec.handle.fail(reason))
            return
        row = step(wire.DECODE_TABLE, rec, f"recv {kind}")
        assert row is not None
        self._track(rec)
        self._emit(session, row, rec.fields)
        handle = rec.handle
        if kind == "CHUNK":
            rec.seen_bytes += frame["nbytes"]
            rec.seen_chunks += 1
            fire.append(lambda: self._progress(handle, frame["nbytes"], last=False))
        elif kind == "DONE":
            fire.append(lambda: self._progress(handle, frame["nbytes"], last=True))
        elif kind == "ABORT":
            reason = peer_reason(session, frame)
            fire.append(lambda: handle.fail(reason))
        elif kind == "ABORT_ACK":
            self.remote_stats.abort_acks_received += 1
            fire.append(handle.writes_drained)

    def _track(self, rec: RecvRecord) -> None:
        """Keep `_claimed` and `_watched` in step with the record's wire state (lock held)."""
        if rec.wire in _WRITABLE:
            self._claimed.add(rec)
        else:
            self._claimed.discard(rec)
        if rec.marker is not None and rec.wire in _MARKABLE:
            self._watched.add(rec)
        else:
            self._watched.discard(rec)

    def _read_markers(self, fire: Fire) -> None:
        """Complete every watched room whose token is in its marker slot (lock held)."""
        markers = self.markers
        assert markers is not None
        for rec in [rec for rec in self._watched if rec.marker is not None and markers.holds(*rec.marker)]:
            assert rec.marker is not None
            self._on_marker(rec, *markers.counts(rec.marker[0]), fire)

    def _read_notifications(self, notes: list[tuple[str, bytes]], fire: Fire) -> None:
        """Complete every watched room whose marker came as one of `notes` (lock held).

        A notification counts only with the token this decode minted for a
        room it still waits on, from the engine of that room's prefill; any
        other (malformed, forged, late, repeated) is counted and dropped.
        """
        waiting = {rec.marker[1]: rec for rec in self._watched if rec.marker is not None}
        for sender, message in notes:
            parsed = parse_notification(message)
            rec = None if parsed is None else waiting.pop(parsed[0], None)
            if parsed is None or rec is None or rec.session.engine_id != sender:
                if rec is not None:
                    assert parsed is not None
                    waiting[parsed[0]] = rec  # another engine named our token: the room still waits
                self.remote_stats.notifications_dropped += 1
                continue
            self._on_marker(rec, parsed[1], parsed[2], fire)

    def _on_marker(self, rec: RecvRecord, nbytes: int, chunks: int, fire: Fire) -> None:
        """The room's own token came back: every byte landed, it succeeds (lock held)."""
        row = step(wire.DECODE_TABLE, rec, "marker")
        assert row is not None
        rec.marked = True
        self._track(rec)
        self.remote_stats.marker_completions += 1
        # Middle chunks whose CHUNK has not come yet count now (their bytes go with the last).
        middle = max(0, min(chunks, wire.MAX_PAGES + 1) - 1 - rec.seen_chunks)
        rest = max(0, min(nbytes, wire.MAX_GEN) - rec.seen_bytes)
        fire.append(functools.partial(self._marked, rec.handle, middle, rest))

    def _copy_aux(self, rec: RecvRecord, frame: codec.Frame) -> bool:
        """Copy a DONE's aux bytes into the room's slot (lock held); False if they do not fit it.

        A DONE without a blob means the engine wrote the slot (or the room has none).
        """
        blob = frame.blob
        if blob is None:
            return True
        if rec.aux is None:
            return False
        assert self.pools is not None
        regions = self.pools.aux
        if len(blob) != sum(region.page_nbytes for region in regions):
            return False
        offset = 0
        for region in regions:
            size = region.page_nbytes
            ctypes.memmove(region.ptr + rec.aux * size, blob[offset : offset + size], size)
            offset += size
        return True

    @classmethod
    def _marked(cls, handle: TransferHandle, middle: int, nbytes: int) -> None:
        for _ in range(middle):
            cls._progress(handle, 0, last=False)
        cls._progress(handle, nbytes, last=True)

    @staticmethod
    def _progress(handle: TransferHandle, nbytes: int, *, last: bool) -> None:
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()
        handle.chunk_done(nbytes, last=last)
        if last:
            handle.transfer_done()

    def _session_lost(self, session: Session, was: SessionState, why: str, fire: Fire) -> None:
        if was is SessionState.HANDSHAKE:
            if session.answered and session.refused is None and not session.bye:
                # It answered, then let our confirmation lapse: evicted, and its BYE did not reach us.
                self._retry(session, why, fire)
                return
            reason = FailureReason(FailureKind.BOOTSTRAP_ERROR, f"prefill at {session.addr} never answered: {why}")
        else:
            reason = FailureReason(FailureKind.PEER_LOST, f"peer {session.addr} lost: {why}")
        for rec in list(session.records.values()):
            if step(wire.DECODE_TABLE, rec, "session_lost") is None:
                continue
            self._track(rec)
            # Its stop (the echo row) reports it drained if nothing of the prefill can land.
            fire.append(functools.partial(rec.handle.fail, reason))

    def _poll_engine(self, now: float) -> float | None:
        wait: float | None = None
        fire: Fire = []
        if self.engine.receiver_progress and self._claimed:
            notes: list[tuple[str, bytes]] = []
            try:
                notes = self.engine.progress()
            except Exception as exc:  # an engine that raises where it should report (NIXL's disconnects)
                self.remote_stats.engine_errors += 1
                logger.debug("kvfsm %s: engine progress raised: %s", self.name, exc)
            if notes:
                with self._lock:
                    self._read_notifications(notes, fire)
            wait = _BUSY_TICK
        if self._watched and not self._notified:
            with self._lock:
                self._read_markers(fire)
            if self._watched:
                wait = min(wait or 1.0, self.config.marker_poll_interval)
        for event in fire:
            event()
        return wait
