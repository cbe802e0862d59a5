"""The decode (receiver) half of a remote endpoint.

A decode endpoint says HELLO to each prefill it meets, sends each room's
destination pages and aux slot (ROOM) once the handshake is answered, and
turns what comes back into lifecycle events: the prefill's CHUNK/DONE
notices or the engine's own notifications (NIXL), ABORT and ABORT_ACK.
Every room carries a token minted here at bootstrap; a message naming a
room with another token is stale and dropped. A failed room is released
(`writes_drained`) only once the prefill's ABORT_ACK proves none of its
writes into our pages is in flight, or at once if it never got the pages.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Hashable

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll
from ._remote_wire import PeerRecord, RemoteEndpoint, parse_notification, peer_reason, pools_from_fields
from .base import BackendError
from .control import ControlMessage

__all__ = ["ReceiverSide"]

logger = logging.getLogger("kvfsm.backends.remote")

#: While a decode expects data it polls a notifying engine every _BUSY_TICK
#: seconds, for _BUSY_SPAN seconds after its last page request or notification.
_BUSY_TICK = 0.0001
_BUSY_SPAN = 0.05


class RecvRoom:
    """One decode room: its token, its prefill, the pages it expects and whether the prefill has them."""

    __slots__ = ("aux", "handle", "pages", "pages_sent", "peer", "peer_aborted", "token")

    def __init__(self, handle: TransferHandle, token: str, peer: str) -> None:
        self.handle = handle
        self.token = token
        self.peer = peer
        self.pages: list[int] | None = None
        self.aux: int | None = None
        self.pages_sent = False
        # Set when the prefill's ABORT failed this room: it knows, so no ABORT goes back.
        self.peer_aborted = False


class ReceiverSide(RemoteEndpoint):
    """Bootstrap, expect, stop and the control messages of a decode endpoint."""

    _recv_by_token: dict[str, RecvRoom]
    _recv_token_of: dict[tuple[Hashable, int], str]
    _busy_until: float
    # Decode rooms whose pages the prefill knows and whose data has not all landed.
    _expecting: set[str]

    def _init_receiver(self) -> None:
        self._recv_by_token = {}
        self._recv_token_of = {}
        self._busy_until = 0.0
        self._expecting = set()

    def _forget_receiver(self, handle: TransferHandle) -> None:
        with self._lock:
            token = self._recv_token_of.pop((handle.room, handle.generation), None)
            rec = None if token is None else self._recv_by_token.pop(token, None)
            if token is not None:
                self._expecting.discard(token)
            if rec is not None:
                peer = self._peers.get(rec.peer)
                if peer is not None:
                    peer.rooms.discard(rec.token)

    def _receiver_rooms_of(self, peer: PeerRecord | None, answered: bool) -> list[tuple[TransferHandle, bool]]:
        """The live rooms with a lost prefill, each with whether it answered the handshake (under the lock)."""
        tokens = peer.rooms if peer is not None else set()
        return [(self._recv_by_token[t].handle, answered) for t in tokens if t in self._recv_by_token]

    def _bootstrap_receiver(self, handle: TransferHandle, peer_addr: str) -> None:
        token = uuid.uuid4().hex
        rec = RecvRoom(handle, token, peer_addr)
        hello = False
        with self._lock:
            self._recv_by_token[token] = rec
            self._recv_token_of[(handle.room, handle.generation)] = token
            peer = self._peers.get(peer_addr)
            if peer is None:
                peer = self._peers[peer_addr] = PeerRecord(peer_addr)
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

    def _recv_room_of(self, handle: TransferHandle) -> RecvRoom | None:
        token = self._recv_token_of.get((handle.room, handle.generation))
        return None if token is None else self._recv_by_token.get(token)

    def _send_room_pages(self, rec: RecvRoom) -> None:
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
        if peer is not None and peer.answered and not rec.peer_aborted:
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
            parsed = parse_notification(message)
            if parsed is None:
                self.remote_stats.stale_messages += 1
                logger.warning("kvfsm %s: malformed engine notification %r dropped", self.name, message[:64])
                continue
            self._receiver_progress(*parsed)
        if notes:
            self._busy_until = now + _BUSY_SPAN
        return _BUSY_TICK if (self._expecting or now < self._busy_until) else None

    def _on_hello_ack(self, message: ControlMessage) -> None:
        session = message["session"]
        problem = session.get("refused") if isinstance(session.get("refused"), str) else None
        pools = None
        if problem is None:
            try:
                pools = pools_from_fields(session.get("pools"))
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
            elif handle.state is KVPoll.Failed and not rec.peer_aborted:
                # It failed while the handshake was in flight: tell the prefill now, so its
                # side of the room does not wait for its bootstrap deadline.
                self._send_abort(rec.peer, handle.room, rec.token, handle.reason)

    def _on_abort_at_receiver(self, message: ControlMessage) -> None:
        rec = self._recv_by_token.get(message["token"] or "")
        if rec is None or rec.handle.room != message["room"]:
            self.remote_stats.stale_messages += 1
            return
        rec.peer_aborted = True
        rec.handle.fail(peer_reason(message))

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
