"""The prefill (sender) half of a remote endpoint: rooms as the decodes describe them.

A prefill endpoint answers each decode's HELLO, matches the decode's ROOM
(destination pages, aux slot, token) with its scheduler's `bootstrap()`
in whichever order they come (keeping an early ROOM or ABORT for
`pending_ttl`, and the failure of a room closed before its ROOM came, so
a late ROOM is answered at once), checks each `send()` against the pages
the decode expects and queues it for the writer thread
(`_remote_writer`), and turns an ABORT from the decode into a failed room
whose writes the writer then drains before it sends ABORT_ACK.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Hashable

from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll
from ._remote_wire import PeerRecord, peer_reason, pools_from_fields
from ._remote_writer import Chunk, SendRoom, WriterThread
from .control import ControlMessage

__all__ = ["SenderSide"]

logger = logging.getLogger("kvfsm.backends.remote")

#: Closed-before-claimed rooms a prefill remembers (bounded memory).
_MAX_TOMBSTONES = 65536


class SenderSide(WriterThread):
    """Bootstrap, send, stop and the control messages of a prefill endpoint."""

    _send_by_room: dict[Hashable, SendRoom]
    _waiting: dict[Hashable, TransferHandle]
    _pending: dict[Hashable, tuple[float, SendRoom | None, ControlMessage]]
    _closed_unclaimed: OrderedDict[Hashable, tuple[float, FailureReason | None]]

    def _init_sender(self) -> None:
        self._send_by_room = {}
        self._waiting = {}
        self._pending = {}
        self._closed_unclaimed = OrderedDict()
        self._work = queue.SimpleQueue()
        self._worker = None

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

    def _expected_pages(self, handle: TransferHandle) -> int | None:
        with self._lock:
            send_room = self._send_by_room.get(handle.room)
            return len(send_room.pages) if send_room is not None and send_room.handle is handle else None

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
        if not send_room.peer_aborted:
            # A failure marked from_peer may come from elsewhere (another rank): the decode still needs telling.
            self._send_abort(send_room.peer, handle.room, send_room.token, handle.reason)
        self._work.put(("stop", send_room))

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
                send_room.peer_aborted = True
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
