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
                                             the WRITE notification (NIXL;
                                             DONE when no aux write carries it)
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
* a room failed by the peer's own ABORT sends none back; any other
  failure does, even one marked `from_peer` (SGLang's "another rank
  failed" is not news to this peer).
* a peer silent for the heartbeat window (or saying BYE): every
  non-terminal room with that peer fails with `PEER_LOST` (or
  `BOOTSTRAP_ERROR` if it never answered the handshake). Its pages wait
  for the drain deadline: a peer we cannot hear may still be writing.

A ROOM or ABORT may reach the prefill before its scheduler calls
`bootstrap()` for that room; it is kept for `pending_ttl` seconds.

The code is split by job: `_remote_engine` (the engine interface below),
`_remote_wire` (what both halves share: config, counters, peer record,
encodings, ABORT), `_remote_sender` (the prefill half), `_remote_writer`
(the prefill's writer thread) and `_remote_receiver` (the decode half). This module puts the
halves together and dispatches to the one an endpoint's role picks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .._manager import TransferHandle, TransferManager
from .._states import TERMINAL, FailureKind, FailureReason, Role
from ._remote_engine import EngineAdapter, EngineJob, PartialSubmit, Write, coalesce_runs
from ._remote_receiver import ReceiverSide
from ._remote_sender import SenderSide
from ._remote_wire import PeerRecord, RemoteConfig, RemoteStats
from .control import ControlMessage, ControlPlane

__all__ = [
    "RemoteConfig",
    "RemoteStats",
    "RemoteBackend",
    "EngineAdapter",
    "EngineJob",
    "PartialSubmit",
    "Write",
    "coalesce_runs",
]

logger = logging.getLogger("kvfsm.backends.remote")


class RemoteBackend(SenderSide, ReceiverSide):
    """A `KVBackend` whose peer is another process; subclasses pick the engine (`_make_engine`)."""

    def __init__(self, manager: TransferManager, config: RemoteConfig | None = None) -> None:
        if config is None:
            config = RemoteConfig()
        if not isinstance(config, RemoteConfig):
            raise TypeError(f"config must be a RemoteConfig; got {type(config).__name__}: {config!r}")
        self.config = config
        self.engine = self._make_engine()
        self.remote_stats = RemoteStats()
        self._lock = threading.Lock()
        self._peers: dict[str, PeerRecord] = {}
        self._init_receiver()
        self._init_sender()
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
            self._start_writer()

    # -- KVBackend: each call goes to the half the role picks ---------------------------------

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
        if self.role is Role.RECEIVER:
            self._forget_receiver(handle)
        else:
            self._forget_sender(handle)

    def _shutdown(self) -> None:
        self._stop_writer()
        self.control.stop()
        self.engine.close()

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

    def _on_peer_lost(self, addr: str, peer_id: str | None, why: str) -> None:
        self.remote_stats.peers_lost += 1
        with self._lock:
            peer = self._peers.pop(addr, None)
            answered = peer is not None and peer.answered
            if self.role is Role.RECEIVER:
                victims = self._receiver_rooms_of(peer, answered)
            else:
                victims = self._sender_rooms_of(addr)
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


_HANDLERS: dict[tuple[Role, str], Callable[[RemoteBackend, ControlMessage], None]] = {
    (Role.SENDER, "HELLO"): RemoteBackend._on_hello,
    (Role.SENDER, "ROOM"): RemoteBackend._on_room,
    (Role.SENDER, "ABORT"): RemoteBackend._on_abort_at_sender,
    (Role.RECEIVER, "HELLO_ACK"): RemoteBackend._on_hello_ack,
    (Role.RECEIVER, "CHUNK"): RemoteBackend._on_chunk,
    (Role.RECEIVER, "DONE"): RemoteBackend._on_done,
    (Role.RECEIVER, "ABORT"): RemoteBackend._on_abort_at_receiver,
    (Role.RECEIVER, "ABORT_ACK"): RemoteBackend._on_abort_ack,
}
